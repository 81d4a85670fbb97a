"""`llmesh router --reuse-port`: several router processes share one port (the router tier of
benchmarks/shard_scaling.py); without the flag a second router on a taken port fails to start
instead of silently taking half the connections."""

from __future__ import annotations

import subprocess
import sys
import time

from router_svc.config import RouterConfig
from services.config import load_config
from services.launcher import free_port

HOST = "127.0.0.1"


def test_the_flag_parses_and_is_off_by_default():
    assert load_config(RouterConfig, [], {}).reuse_port is False
    assert load_config(RouterConfig, ["--reuse-port"], {}).reuse_port is True


def _router(port: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "router_svc.service", "--host", HOST, "--port", str(port), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _listening(proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    """True once it says it listens; False when it exits first."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return False
        if "llmesh router listening" in line:
            return True
    raise TimeoutError("the router neither listened nor exited")


def test_two_routers_share_a_port_only_when_asked():
    port = free_port(HOST)
    procs = [_router(port, "--reuse-port")]
    try:
        assert _listening(procs[0])
        procs.append(_router(port, "--reuse-port"))
        assert _listening(procs[1]) and procs[0].poll() is None
        procs.append(_router(port))  # the default: the port is taken
        assert not _listening(procs[2])
        assert procs[2].wait(30) != 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
