"""A service started by a launcher stops when the launcher dies, even by SIGKILL (real processes).

The launcher is a Python process that starts a real KV store service the way `llmesh up` does
(`services.launcher._spawn`) and is then SIGKILLed: the store drains, exits and unlinks its
shared memory arena instead of living on as an orphan holding its port and memory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.launcher import free_port
from services.parent_watch import LAUNCHER_ENV, launcher_env, watch_launcher

ROOT = Path(__file__).resolve().parents[2]


def test_no_launcher_no_watch_and_the_variable_is_not_passed_on():
    env = {"OTHER": "1"}
    assert watch_launcher(env) is None
    for raw in ("", "x", "1", "-5"):
        env = {LAUNCHER_ENV: raw}
        assert watch_launcher(env) is None
        assert LAUNCHER_ENV not in env  # a process this one starts must not watch that pid
    assert launcher_env({"A": "b"}) == {"A": "b", LAUNCHER_ENV: str(os.getpid())}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="the store's arena lives in /dev/shm")
def test_a_store_whose_launcher_is_sigkilled_drains_exits_and_unlinks_its_arena(tmp_path):
    port = free_port()
    script = textwrap.dedent(
        f"""
        import sys, time
        from services.launcher import _spawn
        proc = _spawn("kvstore_svc.service", ["--port", "{port}", "--memory-bytes", "8MiB"], None,
                      {str(tmp_path)!r}, "kvstore")
        print(proc.pid, flush=True)
        time.sleep(600)
        """
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    store_pid = 0
    try:
        store_pid = int(launcher.stdout.readline())  # type: ignore[union-attr]
        arena = None
        deadline = time.monotonic() + 60
        while arena is None and time.monotonic() < deadline:
            found = [n for n in os.listdir("/dev/shm") if n.startswith(f"llmesh-kvstore-{store_pid}-")]
            arena = found[0] if found else None
            time.sleep(0.1)
        assert arena is not None, (tmp_path / "kvstore.log").read_text()[-2000:]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while _alive(store_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        log = (tmp_path / "kvstore.log").read_text()
        assert not _alive(store_pid), log[-2000:]
        assert "the launcher is gone" in log
        assert not os.path.exists(os.path.join("/dev/shm", arena))  # unlinked by its drain
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if store_pid and _alive(store_pid):
            os.kill(store_pid, signal.SIGKILL)
