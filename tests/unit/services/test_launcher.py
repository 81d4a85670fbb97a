"""The supervisor's restart policy, driven by a fake clock and fake processes (nothing is started)."""

from __future__ import annotations

import logging

import pytest

from services import launcher
from services.launcher import Backoff, Child, LocalMesh, Supervisor
from tests.helpers.clock import Clock


class FakeProc:
    """Enough of subprocess.Popen for the supervisor: poll() and a pid."""

    next_pid = 1000

    def __init__(self) -> None:
        FakeProc.next_pid += 1
        self.pid = FakeProc.next_pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def die(self, code: int) -> None:
        self.returncode = code


@pytest.fixture
def spawned(monkeypatch) -> list[tuple]:
    """Every (module, args, name) the supervisor spawns; each gets a fresh FakeProc."""
    calls: list[tuple] = []

    def fake_spawn(module, args, env, log_dir, name):
        calls.append((module, list(args), name))
        return FakeProc()

    monkeypatch.setattr(launcher, "_spawn", fake_spawn)
    return calls


def make_mesh() -> LocalMesh:
    def child(name: str, module: str, port: int) -> Child:
        return Child(name, f"127.0.0.1:{port}", FakeProc(), module, ["--port", str(port)])

    return LocalMesh(
        child("scheduler", "scheduler_svc.service", 5000),
        [child("worker-0", "worker_svc.service", 5001), child("worker-1", "worker_svc.service", 5002)],
        child("gateway", "gateway.service", 8000),
    )


def make_supervisor(clock: Clock, ready=lambda c: True) -> Supervisor:
    return Supervisor(make_mesh(), Backoff(1.0, 2.0, 30.0, 60.0), clock=clock, ready=ready)


def test_backoff_doubles_up_to_its_cap():
    b = Backoff(initial_s=1, factor=2, max_s=30)
    assert [b.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_dead_child_is_restarted_with_the_same_arguments_after_the_backoff(spawned):
    clock = Clock()
    sup = make_supervisor(clock)
    victim = sup.mesh.child("worker-1")
    old = victim.proc
    old.die(-9)
    sup.poll()  # noticed; restart scheduled 1 s out
    assert victim.proc is old and spawned == []
    clock.now += 0.5
    sup.poll()
    assert spawned == []
    clock.now += 0.6
    sup.poll()
    assert spawned == [("worker_svc.service", ["--port", "5002"], "worker-1")]
    assert victim.proc is not old and victim.proc.poll() is None
    assert sup.restarts("worker-1") == 1
    # The survivors were left alone.
    assert all(sup.restarts(n) == 0 for n in ("scheduler", "worker-0", "gateway"))


def test_a_crash_loop_backs_off_exponentially_and_never_gives_up(spawned):
    clock = Clock()
    sup = make_supervisor(clock)
    gaps = []
    for _ in range(8):
        sup.mesh.child("scheduler").proc.die(1)
        sup.poll()
        before = len(spawned)
        start = clock.now
        while len(spawned) == before:
            clock.now += 0.25
            sup.poll()
        gaps.append(clock.now - start)
    assert gaps == [1, 2, 4, 8, 16, 30, 30, 30]
    assert sup.restarts("scheduler") == 8
    assert all(c.proc.poll() is None for c in sup.mesh.children)


def test_the_backoff_resets_after_a_long_enough_run(spawned):
    clock = Clock()
    sup = make_supervisor(clock)
    w = sup.mesh.child("worker-0")
    for _ in range(3):  # attempts 1, 2, 3 in quick succession
        w.proc.die(1)
        sup.poll()
        clock.now += 10
        sup.poll()
    assert sup._watches["worker-0"].attempt == 3
    clock.now += 61  # stays up past reset_after_s
    w.proc.die(-9)
    sup.poll()
    assert sup._watches["worker-0"].attempt == 1
    assert sup._watches["worker-0"].restart_at == clock.now + 1.0


def test_restarts_are_logged_with_service_exit_code_and_attempt(spawned, caplog):
    clock = Clock()
    ready = {"ok": False}
    sup = make_supervisor(clock, ready=lambda c: ready["ok"])
    caplog.set_level(logging.INFO, logger="services.launcher")
    sup.mesh.child("worker-0").proc.die(-9)
    sup.poll()
    clock.now += 1
    sup.poll()
    sup.poll()  # not ready yet: nothing more logged
    ready["ok"] = True
    clock.now += 3
    sup.poll()
    exited, restarted, serving = caplog.records
    assert (exited.child, exited.exit_code, exited.attempt) == ("worker-0", -9, 1)
    assert "worker-0 exited with code -9" in exited.getMessage()
    assert (restarted.child, restarted.attempt) == ("worker-0", 1)
    assert serving.getMessage() == "worker-0 is serving again after 3.0 s"


def test_nothing_is_restarted_once_stopping(spawned):
    clock = Clock()
    sup = make_supervisor(clock)
    sup.stop()
    for c in sup.mesh.children:
        c.proc.die(0)  # Ctrl-C reached every child
    clock.now += 100
    sup.poll()
    assert spawned == []


def test_a_failed_spawn_is_retried_later(monkeypatch):
    clock = Clock()
    sup = make_supervisor(clock)
    fails = {"n": 1}

    def flaky_spawn(module, args, env, log_dir, name):
        if fails["n"]:
            fails["n"] -= 1
            raise OSError("too many open files")
        return FakeProc()

    monkeypatch.setattr(launcher, "_spawn", flaky_spawn)
    w = sup.mesh.child("gateway")
    w.proc.die(1)
    sup.poll()
    clock.now += 1
    sup.poll()  # spawn fails: attempt 2, 2 s later
    assert w.proc.poll() == 1
    clock.now += 2
    sup.poll()
    assert w.proc.poll() is None
    assert sup.restarts("gateway") == 2


def test_the_kvstore_child_starts_first_stops_last_and_is_restarted_like_the_others(spawned):
    mesh = make_mesh()
    assert mesh.kvstore_address is None
    mesh.kvstore = Child("kvstore", "127.0.0.1:5100", FakeProc(), "kvstore_svc.service", ["--port", "5100"])
    assert [c.name for c in mesh.children] == ["kvstore", "scheduler", "worker-0", "worker-1", "gateway"]
    assert mesh.kvstore_address == "127.0.0.1:5100"
    clock = Clock()
    sup = Supervisor(mesh, Backoff(1.0, 2.0, 30.0, 60.0), clock=clock, ready=lambda c: True)
    mesh.kvstore.proc.die(1)
    sup.poll()
    clock.now += 1.1
    sup.poll()
    assert spawned == [("kvstore_svc.service", ["--port", "5100"], "kvstore")]
