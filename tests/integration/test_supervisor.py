"""`llmesh up`'s supervisor with real processes on loopback: a SIGKILLed worker comes back.

First `Supervisor` on a thread over scheduler + 2 workers (SmolLM2 on the CPU, no gateway:
the gRPC API is enough to see the mesh serve), then `llmesh up` itself as a process: its
flags reach the gateway, it restarts a killed worker, and SIGTERM stops everything.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from services.launcher import Backoff, Supervisor, free_port, grpc_serving, start_mesh
from tests.integration.test_mesh import generate as mesh_generate
from tests.integration.test_mesh import run_concurrently, stats, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORKER_ARGS = ["--kv-cache-memory", str(64 << 20)]
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):", "Water boils at"]


def registered(address: str) -> set[str]:
    return {w.worker_id for w in stats(address).workers}


def connected(address: str) -> set[str]:
    return {w.worker_id for w in stats(address).workers if w.connected}


def generate(address: str, prompt: str) -> list[int]:
    return mesh_generate(address, prompt, max_tokens=8, timeout=120, ignore_eos=True)


def test_a_sigkilled_worker_is_restarted_and_rejoins_while_the_mesh_keeps_serving(tmp_path):
    mesh = start_mesh(2, worker_args=WORKER_ARGS, log_dir=str(tmp_path))
    with Supervisor(mesh, Backoff(initial_s=0.5)).start(interval=0.1) as sup:
        addr = mesh.scheduler.address
        wait_for(lambda: registered(addr) == {"worker-0", "worker-1"}, "both workers registered", 30)
        victim, survivor = mesh.child("worker-1"), mesh.child("worker-0")
        old_pid, address = victim.proc.pid, victim.address
        others = {c.name: c.proc.pid for c in mesh.children if c is not victim}

        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # The survivors serve on while the victim is down or still loading its model.
        for prompt in PROMPTS:
            assert len(generate(addr, prompt)) == 8

        wait_for(lambda: sup.restarts("worker-1") == 1, "restart", 10)
        assert victim.proc.pid != old_pid and victim.address == address  # same port, new process
        # Model loaded in the new process; by then the scheduler has seen the old one's stream break,
        # so a connected worker-1 in GetStats is the new process (re-registered or re-dialled).
        wait_for(lambda: grpc_serving(address), "restarted worker healthy", 60)
        wait_for(lambda: connected(addr) == {"worker-0", "worker-1"}, "worker-1 rejoined", 30)
        print(f"worker-1 back in GetStats {time.monotonic() - killed_at:.1f} s after SIGKILL")
        assert {c.name: c.proc.pid for c in mesh.children if c is not victim} == others

        # The newcomer takes work: a batch spreads over both workers (the router balances load).
        steps_before = {w.worker_id: w.steps for w in stats(addr).workers}
        outs = run_concurrently(lambda p: generate(addr, p), [(p,) for p in PROMPTS * 2], timeout=180)
        assert all(len(o) == 8 for o in outs)
        after = {w.worker_id: w.steps for w in stats(addr).workers}
        assert after["worker-1"] > steps_before["worker-1"], after
        assert survivor.proc.poll() is None and sup.restarts("worker-0") == 0
    # close() stopped supervising first, then every process: none was restarted by the shutdown.
    assert all(c.proc.poll() is not None for c in mesh.children)
    assert sup.restarts("worker-1") == 1


def _read_until(proc: subprocess.Popen, needle: str, timeout: float, lines: list[str]) -> str:
    """Lines of `llmesh up`'s merged output until one contains `needle` (a reader thread feeds `lines`)."""
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        while seen < len(lines):
            seen += 1
            if needle in lines[seen - 1]:
                return lines[seen - 1]
        if proc.poll() is not None and seen == len(lines):
            break
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} not printed; output:\n" + "".join(lines[-40:]))


def _start_up(argv: list[str]) -> tuple[subprocess.Popen, list[str]]:
    """`llmesh up ARGV` as a process; a thread collects its output (and its children's) line by line."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "llmesh.cli", "up", *argv]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []

    def pump() -> None:
        for line in up.stdout:
            lines.append(line)

    threading.Thread(target=pump, daemon=True).start()
    return up, lines


def test_llmesh_up_restarts_a_killed_worker_and_stops_cleanly_on_sigterm():
    port, sched_port = free_port(), free_port()
    up, lines = _start_up(
        ["--port", str(port), "--scheduler-port", str(sched_port), "--worker-args", " ".join(WORKER_ARGS)]
        + ["--api-key", "sekret", "--max-body-bytes", "4096"]
    )
    pids: dict[str, int] = {}
    try:
        _read_until(up, "OpenAI API", 180, lines)
        listed = (re.match(r"\s+(\S+)\s+\S+\s+\(pid (\d+)\)", line) for line in lines)
        pids = {m[1]: int(m[2]) for m in listed if m}
        assert set(pids) == {"kvstore", "scheduler", "worker-0", "gateway"}
        # The KV store is up by default (memory tier), health-gated like the others.
        kvstore = next(m[1] for line in lines if (m := re.match(r"\s+kvstore\s+(\S+)\s+\(pid", line)))
        assert grpc_serving(kvstore)
        # The gateway got its flags: the key (through its environment) and the body cap.
        base, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sekret"}
        assert httpx.get(f"{base}/v1/models").status_code == 401
        model = httpx.get(f"{base}/v1/models", headers=auth).json()["data"][0]["id"]
        assert httpx.post(f"{base}/v1/completions", content=b"x" * 5000, headers=auth).status_code == 413

        os.kill(pids["worker-0"], signal.SIGKILL)
        _read_until(up, "worker-0 exited with code -9", 10, lines)
        restarted = _read_until(up, "worker-0 restarted (attempt 1", 10, lines)
        pids["worker-0"] = int(re.search(r"pid (\d+)", restarted)[1])
        _read_until(up, "worker-0 is serving again", 60, lines)
        body = {"model": model, "prompt": "Hello", "max_tokens": 4}
        wait_for(lambda: connected(f"127.0.0.1:{sched_port}") == {"worker-0"}, "worker-0 rejoined", 30)
        r = httpx.post(f"{base}/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        assert "a service exited; stopping the mesh" not in "".join(lines)  # the old fuse behaviour

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        # It waited for its children: none outlives it (a zombie would still count as alive here).
        assert not [name for name, pid in pids.items() if _alive(pid)]
    finally:
        _stop_all(up, pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_all(up: subprocess.Popen, pids: dict[str, int]) -> None:
    """After a failure too: SIGTERM lets `llmesh up` stop its children; what is left is killed."""
    if up.poll() is None:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
    for pid in pids.values():
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
