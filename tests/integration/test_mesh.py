"""The gRPC mesh as real processes on loopback: scheduler + workers, SmolLM2 on the CPU."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from llmesh.v1 import worker_pb2, worker_pb2_grpc
from services.grpc_server import open_sync_channel
from services.launcher import start_mesh

WORKER_ARGS = ["--kv-cache-memory", str(192 << 20)]
# A dead worker is declared dead after 3 s of re-dialling instead of 30.
FAST_FAILURE_ARGS = ["--worker-dead-after-s", "3"]
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "def add(a, b):",
    "Water boils at",
    "The opposite of hot is",
    "My favourite animal is the",
]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with start_mesh(2, worker_args=WORKER_ARGS, log_dir=str(tmp_path_factory.mktemp("mesh-logs"))) as m:
        yield m


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    from llmesh import LLM, SamplingParams

    llm = LLM(kv_cache_memory=64 << 20)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs, strict=True)}


def stub(address: str) -> gg.SchedulerStub:
    return gg.SchedulerStub(open_sync_channel(address))


def stats(address: str) -> worker_pb2.SchedulerStats:
    with open_sync_channel(address) as channel:
        return worker_pb2_grpc.RegistryStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=10)


def generate(address: str, prompt: str, max_tokens: int = 16, timeout: float = 300, **kw) -> list[int]:
    req = g.GenerateRequest(
        prompt_text=prompt, sampling_params=g.SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    )
    with open_sync_channel(address) as channel:
        return [
            t for resp in gg.SchedulerStub(channel).Generate(req, timeout=timeout) for t in resp.token_ids
        ]


def wait_for(check, what: str, timeout: float = 30.0) -> float:
    """Seconds until `check()` held; fails the test after `timeout`."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.1)
    return time.monotonic() - started


def wait_blocks_free(address: str, timeout: float = 30.0) -> worker_pb2.SchedulerStats:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(address)
        if all(w.free_blocks == w.num_blocks and w.running == 0 and w.waiting == 0 for w in s.workers):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks not returned: {s}")
        time.sleep(0.2)


def run_concurrently(fn, args_list, timeout: float = 300) -> list:
    results: list = [None] * len(args_list)
    errors: list = []

    def target(i, args):
        try:
            results[i] = fn(*args)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return results


def start_streams(address: str, prompts: list[str], max_tokens: int = 24):
    """Generate in threads; returns (threads, results, errors, first-token semaphore)."""
    results: dict[str, list[int]] = {}
    errors: list[Exception] = []
    started = threading.Semaphore(0)

    def client(prompt: str) -> None:
        req = g.GenerateRequest(
            prompt_text=prompt, sampling_params=g.SamplingParams(temperature=0, max_tokens=max_tokens)
        )
        tokens: list[int] = []
        try:
            for resp in stub(address).Generate(req, timeout=300):
                tokens.extend(resp.token_ids)
                started.release()
            results[prompt] = tokens
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    return threads, results, errors, started


def join(threads, timeout: float = 120.0) -> None:
    for t in threads:
        t.join(timeout)


def test_health_and_reflection(mesh):
    for child in [mesh.scheduler, *mesh.workers]:
        resp = health_pb2_grpc.HealthStub(open_sync_channel(child.address)).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(open_sync_channel(mesh.scheduler.address))
    answers = list(
        refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    )
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"llmesh.v1.Scheduler", "llmesh.v1.Registry", "grpc.health.v1.Health"} <= names


def test_concurrent_clients_match_offline_engine_and_spread(mesh, reference):
    got = run_concurrently(lambda p: generate(mesh.scheduler.address, p), [(p,) for p in PROMPTS])
    assert dict(zip(PROMPTS, got, strict=True)) == reference
    s = wait_blocks_free(mesh.scheduler.address)
    assert all(w.steps > 0 for w in s.workers), "requests did not spread over both workers"


def test_shared_prefix_lands_on_the_worker_that_holds_it(mesh):
    prefix = "Here is a long story about a lighthouse keeper and the sea. " * 8
    before = {w.worker_id: w.prefix_hits for w in stats(mesh.scheduler.address).workers}
    generate(mesh.scheduler.address, prefix + "The keeper's name was", max_tokens=2)
    # Keep the other worker idle-equal: the router breaks load ties by prefix hits.
    generate(mesh.scheduler.address, prefix + "At night the lamp", max_tokens=2)
    after = {w.worker_id: w.prefix_hits for w in stats(mesh.scheduler.address).workers}
    gained = {wid: after[wid] - before.get(wid, 0) for wid in after}
    assert max(gained.values()) >= 96  # six+ full 16-token blocks of the prefix were reused
    assert sorted(gained.values())[0] == 0  # ... on one worker only
    wait_blocks_free(mesh.scheduler.address)


def test_cancelled_call_frees_its_blocks(mesh):
    req = g.GenerateRequest(
        prompt_text="Count slowly:",
        sampling_params=g.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
    )
    call = stub(mesh.scheduler.address).Generate(req, timeout=300)
    for i, _ in enumerate(call):
        if i == 2:
            break
    busy = stats(mesh.scheduler.address)
    assert any(w.free_blocks < w.num_blocks for w in busy.workers)
    call.cancel()
    wait_blocks_free(mesh.scheduler.address)


@pytest.mark.parametrize(
    "request_kw, needle",
    [
        (dict(prompt_text="hi", sampling_params=g.SamplingParams(top_p=2.0)), "top_p"),
        (dict(prompt_text="hi", sampling_params=g.SamplingParams(temperature=float("nan"))), "temperature"),
        (dict(prompt_token_ids=g.TokenIds(ids=[]), sampling_params=g.SamplingParams()), "prompt"),
        (dict(prompt_token_ids=g.TokenIds(ids=[1, 10**8])), "vocabulary"),
        (dict(prompt_text="hi", sampling_params=g.SamplingParams(max_tokens=10**6)), "max_tokens"),
        (dict(prompt_text="hi", sampling_params=g.SamplingParams(n=0)), "n"),
        (dict(sampling_params=g.SamplingParams()), "prompt"),
        (
            dict(prompt_text="hi", sampling_params=g.SamplingParams(stop=["x"], detokenize=False)),
            "detokenize",
        ),
        # Structured outputs are checked before anything is submitted (any-language clients).
        (
            dict(
                prompt_text="hi",
                sampling_params=g.SamplingParams(structured_outputs=g.StructuredOutputs(json="{not json")),
            ),
            "structured_outputs.json",
        ),
        (
            dict(
                prompt_text="hi",
                sampling_params=g.SamplingParams(structured_outputs=g.StructuredOutputs(regex="(unclosed")),
            ),
            "structured_outputs.regex",
        ),
    ],
)
def test_bad_requests_get_invalid_argument_and_the_service_stays_up(mesh, request_kw, needle):
    with pytest.raises(grpc.RpcError) as e:
        list(stub(mesh.scheduler.address).Generate(g.GenerateRequest(**request_kw), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details()
    assert len(generate(mesh.scheduler.address, "Hello", max_tokens=2)) == 2


def test_worker_killed_mid_generation_loses_no_request(tmp_path, reference):
    # With --stream-interval 3 the dead worker's requests hold tokens back when it dies: they
    # reach the callers before the requests move, and nothing is lost or sent twice.
    args = [*FAST_FAILURE_ARGS, "--stream-interval", "3"]
    with start_mesh(2, worker_args=WORKER_ARGS, scheduler_args=args, log_dir=str(tmp_path)) as m:
        threads, results, errors, received = start_streams(m.scheduler.address, PROMPTS, max_tokens=16)
        assert received.acquire(timeout=240)  # generation is under way
        busy = max(stats(m.scheduler.address).workers, key=lambda w: w.running)
        assert busy.running > 0
        victim = next(w for w in m.workers if w.name == busy.worker_id)
        victim.proc.send_signal(signal.SIGKILL)
        join(threads, 300)
        assert not errors, errors
        assert results == reference
        s = wait_blocks_free(m.scheduler.address)
        # The dead worker is re-dialled for a while (not routed to), then dropped.
        assert s.failovers > 0 and [w.worker_id for w in s.workers if w.connected] != [victim.name]

        # The last worker gone too: callers get UNAVAILABLE, and the scheduler stays up.
        m.workers[[w.name for w in m.workers].index(victim.name) ^ 1].proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while stats(m.scheduler.address).workers and time.monotonic() < deadline:
            time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as e:
            generate(m.scheduler.address, "Hello", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sigterm_drains_in_flight_requests_then_exits_zero(mesh, reference):
    """Runs last: it stops the module's scheduler."""
    req = g.GenerateRequest(
        prompt_text=PROMPTS[0], sampling_params=g.SamplingParams(temperature=0, max_tokens=16)
    )
    call = stub(mesh.scheduler.address).Generate(req, timeout=300)
    tokens = list(next(call).token_ids)
    os.kill(mesh.scheduler.proc.pid, signal.SIGTERM)
    for resp in call:
        tokens.extend(resp.token_ids)
    assert tokens == reference[PROMPTS[0]]
    assert mesh.scheduler.proc.wait(60) == 0
