"""Services started by a launcher (`llmesh up`, the tests' meshes) leave when it dies, even by SIGKILL.

Without this, a launcher killed hard (SIGKILL, the OOM killer) left its scheduler, workers,
gateway and KV store running as orphans: holding their ports, their GPU memory and the store's
shared memory arena, so that the next `llmesh up` could not bind. The launcher names itself in
LLMESH_LAUNCHER_PID; a service whose parent is no longer that process (it was re-parented)
stops as on SIGTERM: it drains and exits, unlinking what it owns. A service started without
the variable (by hand, by Kubernetes, by docker-compose) watches nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

LAUNCHER_ENV = "LLMESH_LAUNCHER_PID"
POLL_S = 1.0
# A SIGTERM that landed before the service installed its handlers (it was starting) is lost:
# sent again after this long, and then each time, until the process is gone.
RESEND_S = 30.0


def launcher_env(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child this process launches (and watches it by)."""
    return {**(os.environ if env is None else env), LAUNCHER_ENV: str(os.getpid())}


def watch_launcher(
    environ: MutableMapping[str, str] | None = None, poll_s: float = POLL_S, resend_s: float = RESEND_S
) -> threading.Thread | None:
    """Stop this process (SIGTERM to itself) once the launcher that started it is gone.

    The variable is taken out of `environ` (default os.environ), so that processes this one
    starts (gateway server processes, tensor-parallel ranks) do not watch a pid that is not
    their parent.
    """
    environ = os.environ if environ is None else environ
    raw = environ.pop(LAUNCHER_ENV, "")
    try:
        launcher = int(raw)
    except ValueError:
        return None
    if launcher <= 1:
        return None

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        log.warning("the launcher is gone: stopping", extra={"launcher_pid": launcher})
        while True:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(resend_s)

    thread = threading.Thread(target=watch, name="llmesh-launcher-watch", daemon=True)
    thread.start()
    return thread
