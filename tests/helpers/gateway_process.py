"""One more gateway process in front of a running mesh's scheduler, for tests that need a gateway
configured otherwise (an API key, a Redis for stored responses).

    with extra_gateway(mesh.scheduler.address, tmp_path / "gw.log", env={"LLMESH_API_KEY": key}) as url:
        ...                              # http://127.0.0.1:PORT, serving (its /health answered 200)
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from services.ports import free_port


@contextlib.contextmanager
def extra_gateway(
    scheduler: str, log_path: Path, env: dict[str, str] | None = None, args: list[str] | None = None
) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.service", "--port", str(port), "--scheduler", scheduler]
    cmd += ["--log-format", "text", *(args or [])]
    with open(log_path, "wb") as log:  # the child keeps its own copy
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the extra gateway did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)
