"""`llmesh up` as a new user runs it (`make run`), left idle for 75 s, then used.

In a whole-suite run the mesh is started with the session and idles while the other tests run
(tests/helpers/long_idle.py): the test runs last and waits for what is left of the 75 s.

The mesh used to die ~60-70 s after start when idle: the clients' keepalive pings
broke the servers' ping policy (GOAWAY "too_many_pings"). Default settings only
(keepalive 20 s: 75 s is almost four ping periods, past where it died; it was 180 s, then
100 s: make test's 20-minute budget took the difference, and neither caught anything 75 s
does not), on free ports. Since `llmesh up` restarts dead services, a link that dropped
could hide behind a restart: the test also checks that no service exited and that the
worker's Step stream never broke.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.helpers.long_idle import IDLE_MESH, READY_TIMEOUT_S, IdleMesh
from tests.integration.test_mesh import stats
from tests.integration.test_supervisor import _alive, _stop_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(330)]

IDLE_S = 75


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, their children, ...), from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid ...": comm may hold spaces or parentheses; split after the last ")"
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        kids = {p for p, pp in parents.items() if pp == parent and p not in found}
        found |= kids
        frontier.extend(kids)
    return found


@pytest.fixture
def idle_mesh(request) -> IdleMesh:
    """Started with the session when it runs the whole suite (tests/conftest.py), else here."""
    mesh = request.config.stash.get(IDLE_MESH, None) or IdleMesh.start()
    request.addfinalizer(mesh.stop)
    return mesh


def test_llmesh_up_with_defaults_serves_after_a_long_idle(idle_mesh):
    import openai

    up, lines, port, sched_port = idle_mesh.up, idle_mesh.lines, idle_mesh.port, idle_mesh.sched_port
    assert idle_mesh.ready.wait(READY_TIMEOUT_S + 30), "".join(lines[-40:])
    assert not idle_mesh.error, idle_mesh.error + "\n" + "".join(lines[-40:])
    pids = idle_mesh.pids
    try:
        assert set(pids) == {"kvstore", "scheduler", "worker-0", "gateway"}, lines
        base = f"http://127.0.0.1:{port}"  # /health answered 200 once ready (IdleMesh)

        # Nothing at all since then: no request, no health check (longer when the rest of the
        # suite ran meanwhile).
        time.sleep(max(0.0, idle_mesh.ready_at + IDLE_S - time.monotonic()))

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert chat.usage.completion_tokens >= 1
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200

        # Nothing died and came back behind our back, and no link was dropped and re-dialled.
        output = "".join(lines)
        assert " exited with code " not in output, output[-4000:]
        assert "too_many_pings" not in output, output[-4000:]
        assert all(_alive(pid) for pid in pids.values()), pids
        workers = stats(f"127.0.0.1:{sched_port}").workers
        assert [(w.worker_id, w.connected, w.reconnects) for w in workers] == [("worker-0", True, 0)]

        children = _descendants(up.pid)
        assert set(pids.values()) <= children, (pids, children)
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        # It waited for every process it started: none outlives it (a zombie would count as alive).
        assert not [pid for pid in children if _alive(pid)], children
    finally:
        _stop_all(up, pids)
