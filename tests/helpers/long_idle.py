"""The long-idle test's mesh, started when the session starts so that its idle overlaps the others.

tests/integration/test_long_idle.py leaves `llmesh up` idle for 75 s before using it. Sleeping
those 75 s in the test cost make test 75 s; started as the session starts (tests/conftest.py,
when that test is selected), the mesh idles while the rest of the suite runs, and the test, run
last, waits only for what is left of the 75 s. Its idle is never shorter, only longer: a link
that dies past 75 s fails it as well. Under pytest-xdist (`make test` runs two workers) the worker
that will run the test is not known at collection, so every worker starts one such mesh with its
session; the others' idle unused and stop with their sessions, a few seconds of start-up each
against 75 s of idle waited in the test.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from services.launcher import free_port

TEST_NODEID = "tests/integration/test_long_idle.py::test_llmesh_up_with_defaults_serves_after_a_long_idle"
READY_TIMEOUT_S = 180


def start_with_the_session(config: pytest.Config, items: list[pytest.Item]) -> None:
    """If the long-idle test is selected: start its mesh now (stashed on `config`, stopped when the
    session ends) and run the test last (every xdist worker reorders alike, as xdist requires).
    Not when only collecting, nor in an xdist controller (it runs no test)."""
    import os

    controller = getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER")
    if config.option.collectonly or controller:
        return
    selected = [item for item in items if item.nodeid == TEST_NODEID]
    if not selected or len(items) == 1:
        return  # alone, the test starts its mesh itself: the same
    items[:] = [item for item in items if item.nodeid != TEST_NODEID] + selected
    mesh = IdleMesh.start()
    config.stash[IDLE_MESH] = mesh
    config.add_cleanup(mesh.stop)


@dataclass
class IdleMesh:
    """`llmesh up` on free ports; a thread waits for it to be ready and checks /health once."""

    up: subprocess.Popen
    lines: list[str]
    port: int
    sched_port: int
    ready: threading.Event = field(default_factory=threading.Event)
    ready_at: float = 0.0  # time.monotonic() of the last request before the idle
    pids: dict[str, int] = field(default_factory=dict)
    error: str = ""

    @classmethod
    def start(cls) -> IdleMesh:
        from tests.integration.test_supervisor import _start_up

        port, sched_port = free_port(), free_port()
        up, lines = _start_up(["--port", str(port), "--scheduler-port", str(sched_port)])
        mesh = cls(up, lines, port, sched_port)
        threading.Thread(target=mesh._await_ready, name="long-idle-ready", daemon=True).start()
        return mesh

    def _await_ready(self) -> None:
        from tests.integration.test_supervisor import _read_until

        try:
            _read_until(self.up, "OpenAI API", READY_TIMEOUT_S, self.lines)
            listed = (re.match(r"\s+(\S+)\s+\S+\s+\(pid (\d+)\)", line) for line in self.lines)
            self.pids = {m[1]: int(m[2]) for m in listed if m}
            status = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=10).status_code
            if status != 200:
                self.error = f"/health answered {status} once ready"
        except Exception as e:  # reported by the test, with the output
            self.error = f"not ready: {e!r}"
        self.ready_at = time.monotonic()  # the idle starts after the last request
        self.ready.set()

    def stop(self) -> None:
        from tests.integration.test_supervisor import _stop_all

        _stop_all(self.up, self.pids)


IDLE_MESH = pytest.StashKey[IdleMesh]()
