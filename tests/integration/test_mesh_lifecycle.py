"""The mesh as a user leaves it running: idle past keepalives, cut streams, restarts, pauses, strangers.

Real processes on loopback with short keepalive and failure settings, so that
what takes minutes in production takes seconds here. Tests run in file order:
the disruptive ones (scheduler restart, a paused worker) come last.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import worker_pb2, worker_pb2_grpc
from services.grpc_server import open_sync_channel
from services.launcher import grpc_serving, start_mesh
from services.step import STEP_TOKEN_METADATA
from tests.integration.test_mesh import (
    generate,
    join,
    run_concurrently,
    start_streams,
    stats,
    stub,
    wait_blocks_free,
    wait_for,
)

STEP_TOKEN = "lifecycle-test-token"
KEEPALIVE = ["--keepalive-s", "1"]
WORKER_ARGS = ["--kv-cache-memory", str(192 << 20), "--rejoin-after-s", "1", "--step-token", STEP_TOKEN]
SCHEDULER_ARGS = ["--worker-dead-after-s", "4", "--failover-after-s", "0.5"]
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):", "Water boils at"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("lifecycle-logs")
    with start_mesh(
        2,
        worker_args=[*WORKER_ARGS, *KEEPALIVE],
        scheduler_args=[*SCHEDULER_ARGS, *KEEPALIVE],
        log_dir=str(log_dir),
    ) as m:
        m.log_dir = log_dir  # type: ignore[attr-defined]
        yield m


@pytest.fixture(scope="module")
def reference(mesh) -> dict[str, list[int]]:
    """Greedy tokens of an undisturbed mesh (the same engine, so any loss or duplicate shows)."""
    return {p: generate(mesh.scheduler.address, p, max_tokens=24) for p in PROMPTS}


def connected_workers(address: str) -> list[str]:
    try:
        return sorted(w.worker_id for w in stats(address).workers if w.connected)
    except grpc.RpcError:  # the scheduler is (re)starting
        return []


def test_idle_past_many_keepalive_periods_then_serves(mesh, reference):
    generate(mesh.scheduler.address, "warm up", max_tokens=2)
    time.sleep(8)  # 8 keepalive periods of 1 s: a ping policy that disagrees kills links in ~3 s
    assert generate(mesh.scheduler.address, PROMPTS[0], max_tokens=24) == reference[PROMPTS[0]]
    s = stats(mesh.scheduler.address)
    assert all(w.connected and w.reconnects == 0 for w in s.workers), s


def test_step_stream_without_the_token_is_refused(mesh):
    worker = mesh.workers[0]
    call = worker_pb2_grpc.WorkerStub(open_sync_channel(worker.address)).Step(iter([]))
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    s = stats(mesh.scheduler.address)
    assert all(w.connected and w.reconnects == 0 for w in s.workers), s
    assert len(generate(mesh.scheduler.address, "Hello", max_tokens=2)) == 2


def test_replayed_registration_changes_nothing(mesh, reference):
    threads, results, errors, started = start_streams(mesh.scheduler.address, PROMPTS)
    assert started.acquire(timeout=60)
    registry = worker_pb2_grpc.RegistryStub(open_sync_channel(mesh.scheduler.address))
    for w in mesh.workers:
        resp = registry.RegisterWorker(
            worker_pb2.RegisterWorkerRequest(address=w.address, worker_id=w.name, step_token="forged"),
            timeout=30,
        )
        assert resp.accepted, resp.message
    join(threads)
    assert not errors, errors
    assert results == reference
    s = wait_blocks_free(mesh.scheduler.address)
    assert all(w.connected and w.reconnects == 0 for w in s.workers), s


def test_step_stream_cut_from_the_worker_side_is_won_back(mesh, reference):
    """A second Step stream (here: a client holding the token) replaces the scheduler's at the worker."""
    threads, results, errors, started = start_streams(mesh.scheduler.address, PROMPTS, max_tokens=24)
    assert started.acquire(timeout=60)
    for w in mesh.workers:
        intruder = worker_pb2_grpc.WorkerStub(open_sync_channel(w.address)).Step(
            iter([worker_pb2.StepPlan(step_id=0)]), metadata=((STEP_TOKEN_METADATA, STEP_TOKEN),)
        )
        try:
            assert [r.step_id for r in intruder] == [0]
        except grpc.RpcError as e:  # the scheduler's reconnect replaced the intruder first
            assert e.code() == grpc.StatusCode.ABORTED, e
    join(threads)
    assert not errors, errors
    assert results == reference  # nothing lost, nothing duplicated
    wait_for(lambda: connected_workers(mesh.scheduler.address) == ["worker-0", "worker-1"], "reconnect")
    s = wait_blocks_free(mesh.scheduler.address)
    assert sum(w.reconnects for w in s.workers) >= 1, s


def test_abort_ends_every_choice_of_the_stream_at_once(mesh):
    req = g.GenerateRequest(
        request_id="c",
        prompt_text="Count slowly:",
        sampling_params=g.SamplingParams(n=2, max_tokens=2000, ignore_eos=True, seed=1),
    )
    call = stub(mesh.scheduler.address).Generate(req, timeout=120)
    first = next(call)
    assert first.request_id == "c"
    started = time.monotonic()
    aborted = stub(mesh.scheduler.address).Abort(g.AbortRequest(request_ids=["c"]), timeout=10)
    assert list(aborted.aborted_ids) == ["c"]
    rest = list(call)
    assert time.monotonic() - started < 5
    finished = {r.index: r.finish_reason for r in [first, *rest] if r.finish_reason}
    assert finished == {0: g.FINISH_REASON_ABORT, 1: g.FINISH_REASON_ABORT}
    assert rest[-1].HasField("usage") and rest[-1].usage.completion_tokens > 0
    wait_blocks_free(mesh.scheduler.address)


def test_a_request_cannot_address_another_requests_choices(mesh):
    req = g.GenerateRequest(
        request_id="c",
        prompt_text="Count slowly:",
        sampling_params=g.SamplingParams(n=2, max_tokens=40, ignore_eos=True, temperature=0),
    )
    call = stub(mesh.scheduler.address).Generate(req, timeout=120)
    responses = [next(call)]
    # "c/0" is just another request id: it runs on its own, and neither it nor an Abort of it touches c.
    other = g.GenerateRequest(
        request_id="c/0", prompt_text="Hello", sampling_params=g.SamplingParams(max_tokens=2)
    )
    assert sum(len(r.token_ids) for r in stub(mesh.scheduler.address).Generate(other, timeout=60)) == 2
    assert list(stub(mesh.scheduler.address).Abort(g.AbortRequest(request_ids=["c/0"])).aborted_ids) == []
    with pytest.raises(grpc.RpcError) as e:
        list(
            stub(mesh.scheduler.address).Generate(
                g.GenerateRequest(request_id="c", prompt_text="x"), timeout=10
            )
        )
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    responses += list(call)
    tokens = {0: 0, 1: 0}
    for r in responses:
        tokens[r.index] += len(r.token_ids)
    assert tokens == {0: 40, 1: 40}
    assert responses[-1].usage.completion_tokens == 80


@pytest.mark.parametrize(
    "params, needle",
    [
        (g.SamplingParams(stop=[f"s{i}" for i in range(17)]), "stop"),
        (g.SamplingParams(stop=["x" * 257]), "stop"),
        (g.SamplingParams(stop_token_ids=list(range(65))), "stop_token_ids"),
        (g.SamplingParams(stop_token_ids=[10**8]), "stop_token_ids"),
        (g.SamplingParams(n=17), "n"),
    ],
)
def test_grpc_has_the_same_limits_as_http(mesh, params, needle):
    with pytest.raises(grpc.RpcError) as e:
        list(
            stub(mesh.scheduler.address).Generate(g.GenerateRequest(prompt_text="hi", sampling_params=params))
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details()


def test_megabyte_text_prompt_is_refused_before_tokenizing(mesh):
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(stub(mesh.scheduler.address).Generate(g.GenerateRequest(prompt_text="word " * 1_000_000)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert time.monotonic() - started < 2.0


def test_scheduler_restart_gets_its_workers_back(mesh, reference):
    sched = mesh.scheduler
    sched.proc.send_signal(signal.SIGKILL)
    sched.proc.wait(10)
    sched.respawn()  # same port; workers are not restarted
    # Workers notice their Step stream is gone and register again (--rejoin-after-s 1).
    wait_for(lambda: len(connected_workers(sched.address)) == 2, "workers re-registered", timeout=60)
    wait_for(lambda: grpc_serving(sched.address), "scheduler serving", timeout=60)
    got = run_concurrently(lambda p: generate(sched.address, p, max_tokens=24), [(p,) for p in PROMPTS])
    assert dict(zip(PROMPTS, got, strict=True)) == reference


def test_worker_paused_past_its_deadline_rejoins(mesh, reference):
    victim = mesh.workers[0]
    threads, results, errors, started = start_streams(mesh.scheduler.address, PROMPTS, max_tokens=24)
    assert started.acquire(timeout=60)
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        # Keepalive (1 s) notices, its requests move to worker-1, and after 4 s it is dropped.
        wait_for(
            lambda: victim.name not in [w.worker_id for w in stats(mesh.scheduler.address).workers],
            "paused worker dropped",
            timeout=30,
        )
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    join(threads)
    assert not errors, errors
    assert results == reference
    wait_for(lambda: connected_workers(mesh.scheduler.address) == ["worker-0", "worker-1"], "rejoin")
    got = run_concurrently(
        lambda p: generate(mesh.scheduler.address, p, max_tokens=24), [(p,) for p in PROMPTS]
    )
    assert dict(zip(PROMPTS, got, strict=True)) == reference
    wait_blocks_free(mesh.scheduler.address)


def test_lone_worker_paused_briefly_keeps_its_requests(tmp_path, reference):
    """Paused shorter than the dead deadline: the same process comes back and its requests finish."""
    with start_mesh(
        1,
        worker_args=[*WORKER_ARGS, *KEEPALIVE],
        scheduler_args=["--worker-dead-after-s", "30", *KEEPALIVE],
        log_dir=str(tmp_path),
    ) as m:
        threads, results, errors, started = start_streams(m.scheduler.address, PROMPTS[:2], max_tokens=24)
        assert started.acquire(timeout=60)
        os.kill(m.workers[0].proc.pid, signal.SIGSTOP)
        time.sleep(4)  # the link breaks (keepalive) and re-dials fail meanwhile
        os.kill(m.workers[0].proc.pid, signal.SIGCONT)
        join(threads)
        assert not errors, errors
        assert results == {p: reference[p] for p in PROMPTS[:2]}
        s = wait_blocks_free(m.scheduler.address)
        assert s.workers[0].connected
