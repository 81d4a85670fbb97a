"""`--api-server-count N`: N gateway processes on one port, supervised by this one.

One Python process streaming to hundreds of clients is bound by one core: parsing HTTP,
reading the scheduler's gRPC messages, detokenizing and writing SSE events all take the GIL.
Here each of N processes (`python -m gateway.service ... --reuse-port`) binds the same port
with SO_REUSEPORT, so the kernel spreads new connections over their accept queues; each has
its own event loop, tokenizer and channel to the scheduler. A process takes connections only
once it knows the served model (up to a minute), so a client never meets one still starting.

This process only supervises: it restarts a process that dies (with a backoff), forwards
SIGTERM/SIGINT as SIGTERM (each process drains its streams), and exits 0 once all have exited.
The processes run in their own process group, so a terminal's Ctrl-C reaches them once,
through here, and each exits by itself should this process be killed.

Metrics: prometheus_client's multiprocess mode. Every process writes its samples to files in
one directory (PROMETHEUS_MULTIPROC_DIR, a fresh temporary one unless set); /metrics, answered
by whichever process the connection landed on, sums them over all processes (gauges of live
processes only), and adds the scheduler's live gauges once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from gateway.config import GatewayConfig
from services.parent_watch import launcher_env

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
DRAIN_S = 45.0  # uvicorn's graceful shutdown (30 s) plus margin, then SIGKILL
QUICK_EXIT_S = 10.0  # a process that dies sooner than this after its start failed to start
MAX_QUICK_EXITS = 3  # ... this many times in a row: give up, the configuration is at fault


@dataclass
class _Proc:
    index: int
    popen: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    quick_exits: int = 0
    restart_at: float | None = None


def claim_port(host: str, port: int) -> int:
    """The port the processes will share: a busy one fails here (a bind without SO_REUSEPORT),
    rather than being shared with whatever holds it; 0 picks a free one."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(addr)
        return probe.getsockname()[1]


def run_processes(config: GatewayConfig, argv: list[str]) -> int:
    count = config.api_server_count
    try:
        port = claim_port(config.host, config.port)
    except OSError as e:
        print(f"llmesh gateway: cannot bind {config.host}:{config.port}: {e}", file=sys.stderr, flush=True)
        return 1
    own_dir = not os.environ.get(MULTIPROC_ENV)
    metrics_dir = tempfile.mkdtemp(prefix="llmesh-gateway-metrics-") if own_dir else os.environ[MULTIPROC_ENV]
    # Each server process drains and exits when this supervisor is gone (SIGKILL, say).
    env = launcher_env({**os.environ, MULTIPROC_ENV: metrics_dir})
    # Later flags win: every process binds the one port, with SO_REUSEPORT, and runs alone.
    args = [*argv, "--api-server-count", "1", "--reuse-port", "--port", str(port)]
    cmd = [sys.executable, "-m", "gateway.service", *args]
    stopping = False
    signalled: set[int] = set()

    def spawn() -> subprocess.Popen:
        return subprocess.Popen(cmd, env=env, process_group=0)

    def on_signal(signum, frame) -> None:  # noqa: ARG001
        nonlocal stopping
        stopping = True
        for p in procs:  # SIGTERM once each: every process drains its streams, then exits 0
            if p.popen.poll() is None and p.popen.pid not in signalled:
                signalled.add(p.popen.pid)
                with contextlib.suppress(ProcessLookupError):
                    p.popen.send_signal(signal.SIGTERM)

    procs: list[_Proc] = []
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        procs.extend(_Proc(i, spawn()) for i in range(count))
        print(
            f"llmesh gateway on http://{config.host}:{port} -> scheduler {config.scheduler} "
            f"({count} processes: {', '.join(str(p.popen.pid) for p in procs)})",
            flush=True,
        )
        while not stopping:
            time.sleep(0.2)  # a signal interrupts it
            if stopping:
                break
            code = _supervise(procs, spawn, metrics_dir)
            if code:
                break
    finally:
        on_signal(signal.SIGTERM, None)
        deadline = time.monotonic() + DRAIN_S
        for p in procs:
            try:
                p.popen.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
        if own_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return code


def _supervise(procs: list[_Proc], spawn, metrics_dir: str) -> int:
    """One pass: restart dead processes (after their backoff); 1 when one cannot start at all."""
    now = time.monotonic()
    for p in procs:
        if p.restart_at is None:
            rc = p.popen.poll()
            if rc is None:
                continue
            _mark_dead(p.popen.pid, metrics_dir)
            uptime = now - p.started
            p.quick_exits = p.quick_exits + 1 if uptime < QUICK_EXIT_S else 0
            if p.quick_exits >= MAX_QUICK_EXITS:
                log.error("gateway process %d keeps exiting at start (code %s); stopping", p.index, rc)
                return 1
            delay = min(2.0 ** max(p.quick_exits - 1, 0), 30.0)
            log.warning(
                "gateway process %d (pid %d) exited with code %s after %.1f s; restarting in %.0f s",
                p.index,
                p.popen.pid,
                rc,
                uptime,
                delay,
            )
            p.restart_at = now + delay
        if p.restart_at is not None and now >= p.restart_at:
            p.popen, p.started, p.restart_at = spawn(), now, None
    return 0


def _mark_dead(pid: int, metrics_dir: str) -> None:
    """Drop a dead process's live gauges from the sums (its counters and histograms stay)."""
    with contextlib.suppress(Exception):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, metrics_dir)
