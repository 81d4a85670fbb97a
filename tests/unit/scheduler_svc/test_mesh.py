"""The Mesh without sockets: workers behind LocalWorkerLink, plans in flight, links that break."""

from __future__ import annotations

import asyncio
import time

import pytest

from llmesh.local_link import LocalWorkerLink
from scheduler_svc.mesh import Connected, LinkBroken, Mesh, MeshConfig, NoWorkerAvailable
from scheduler_svc.planner import PlannerConfig
from services.sampling_params import SamplingParams
from services.step import StepResult, WorkerInfo
from tests.unit.scheduler_svc.test_planner import CountingWorker

INFO = WorkerInfo(
    "m", b"fp", block_size=8, num_kv_blocks=200, max_model_len=512, vocab_size=100, eos_token_ids=[7]
)
PROMPTS = {f"r{i}": [(i * 13 + j * 7) % 90 + 3 for j in range(5 + 3 * i)] for i in range(8)}


def mesh_config(async_scheduling: bool = True, **kw) -> MeshConfig:
    planner = PlannerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    return MeshConfig(planner=planner, async_scheduling=async_scheduling, **kw)


async def collect(mesh: Mesh, max_tokens: int = 30) -> dict[str, list[int]]:
    async def one(rid: str, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for delta in mesh.generate(rid, prompt, SamplingParams(max_tokens=max_tokens)):
            tokens.extend(delta.new_token_ids)
        return tokens

    outs = await asyncio.gather(*(one(rid, p) for rid, p in PROMPTS.items()))
    return dict(zip(PROMPTS, outs, strict=True))


def local(worker: CountingWorker, info: WorkerInfo = INFO) -> LocalWorkerLink:
    return LocalWorkerLink(worker.execute, info, worker.seqs.clear)


async def run_mesh(async_scheduling: bool) -> dict[str, list[int]]:
    mesh = Mesh(mesh_config(async_scheduling))
    mesh.add_worker("w", INFO, local(CountingWorker()))
    out = await collect(mesh)
    await mesh.remove_worker("w")
    return out


async def test_async_scheduling_gives_the_same_tokens_as_one_plan_at_a_time():
    sync, pipelined = await run_mesh(False), await run_mesh(True)
    assert sync == pipelined
    assert any(len(t) < 30 for t in sync.values())  # some stopped on EOS with a plan in flight


class FlakyLink(LocalWorkerLink):
    """Breaks its stream after `break_after` results (the worker process lives on)."""

    def __init__(self, worker: CountingWorker, break_after: int) -> None:
        super().__init__(worker.execute, INFO, worker.seqs.clear)
        self.left = break_after
        self.connects = 0

    async def connect(self, timeout_s: float = 10.0) -> Connected:
        self.connects += 1
        return await super().connect(timeout_s)

    async def recv(self) -> StepResult:
        self.left -= 1
        if self.left == 0:
            await super().recv()  # the step ran (its KV is written) but its result is lost
            raise LinkBroken("stream cut")
        return await super().recv()


async def test_a_cut_stream_is_redialled_and_nothing_is_lost():
    reference = await run_mesh(False)
    for break_after in (1, 3, 7, 15):
        mesh = Mesh(mesh_config())
        link = FlakyLink(CountingWorker(), break_after)
        mesh.add_worker("w", INFO, link)
        assert await collect(mesh) == reference
        assert link.connects == 1 and mesh.workers["w"].num_reconnects == 1
        assert mesh.workers["w"].planner.blocks.num_free_blocks == INFO.num_kv_blocks
        await mesh.remove_worker("w")


class DeadLink(LocalWorkerLink):
    """A worker that dies after `die_after` results and never answers again."""

    def __init__(self, worker: CountingWorker, die_after: int) -> None:
        super().__init__(worker.execute, INFO, worker.seqs.clear)
        self.left = die_after

    async def connect(self, timeout_s: float = 10.0) -> Connected:
        raise LinkBroken("connection refused")

    async def recv(self) -> StepResult:
        self.left -= 1
        if self.left <= 0:
            raise LinkBroken("worker died")
        return await super().recv()


async def test_a_dead_worker_with_two_plans_in_flight_fails_over():
    reference = await run_mesh(False)
    mesh = Mesh(mesh_config(worker_dead_after_s=0.5, failover_after_s=0.1))
    mesh.add_worker("dying", INFO, DeadLink(CountingWorker(), die_after=4))
    mesh.add_worker("healthy", INFO, local(CountingWorker()))
    assert await collect(mesh) == reference
    assert mesh.num_failovers > 0
    await asyncio.sleep(0.6)
    assert list(mesh.workers) == ["healthy"]
    await mesh.remove_worker("healthy")


async def test_abort_ends_the_stream_with_a_last_delta():
    mesh = Mesh(mesh_config())
    mesh.add_worker("w", INFO, local(CountingWorker()))
    queue = mesh.submit("a", PROMPTS["r1"], SamplingParams(max_tokens=400, ignore_eos=True))
    first = await queue.get()
    assert not first.finished
    assert mesh.abort("a")
    while True:
        delta = await asyncio.wait_for(queue.get(), 5)
        if delta.finished:
            break
    assert delta.finish_reason == "abort"
    await asyncio.sleep(0.05)
    planner = mesh.workers["w"].planner
    assert not planner.has_unfinished() and planner.blocks.num_free_blocks == INFO.num_kv_blocks
    await mesh.remove_worker("w")


class PoisonedWorker(CountingWorker):
    """Rejects every plan that holds the sequence "poison" (its step fails each time)."""

    def execute(self, plan):
        if any(s.seq_id == "poison" for s in plan.new_seqs):
            raise ValueError("this sequence breaks the worker")
        return super().execute(plan)


async def test_a_plan_that_breaks_the_worker_every_time_is_not_replayed_forever():
    mesh = Mesh(mesh_config())
    worker = PoisonedWorker()
    mesh.add_worker("w", INFO, local(worker))
    with pytest.raises(NoWorkerAvailable):
        async for _ in mesh.generate("poison", [5, 6, 7], SamplingParams(max_tokens=4)):
            pass
    assert mesh.workers["w"].connected or await asyncio.sleep(0.1) is None
    tokens = []
    async for delta in mesh.generate("fine", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)):
        tokens.extend(delta.new_token_ids)
    assert len(tokens) == 4  # the worker serves others after its poisoned request is failed
    await mesh.remove_worker("w")


async def deltas_of(mesh: Mesh, max_tokens: int) -> dict[str, list[list[int]]]:
    """Every request's deltas (token lists), in order."""

    async def one(rid: str, prompt: list[int]) -> list[list[int]]:
        sp = SamplingParams(max_tokens=max_tokens)
        return [list(d.new_token_ids) async for d in mesh.generate(rid, prompt, sp)]

    outs = await asyncio.gather(*(one(rid, p) for rid, p in PROMPTS.items()))
    return dict(zip(PROMPTS, outs, strict=True))


async def test_stream_interval_batches_tokens_and_loses_none():
    reference = await run_mesh(False)
    for interval in (1, 3, 8):
        mesh = Mesh(mesh_config(stream_interval=interval))
        mesh.add_worker("w", INFO, local(CountingWorker()))
        got = await deltas_of(mesh, 30)
        await mesh.remove_worker("w")
        assert {rid: [t for d in ds for t in d] for rid, ds in got.items()} == reference
        for ds in got.values():
            assert len(ds[0]) == 1  # the first token is never held (time to first token)
            # between the first and the last delta, each carries at least `interval` tokens
            assert all(len(d) >= interval for d in ds[1:-1])
        if interval > 1:
            assert max(len(ds) for ds in got.values()) <= 2 + 30 // interval


class SlowWorker(CountingWorker):
    def execute(self, plan):
        time.sleep(0.002)
        return super().execute(plan)


async def test_stream_interval_flushes_held_tokens_on_abort_and_failover():
    # Abort: what was held goes out before the last delta.
    mesh = Mesh(mesh_config(stream_interval=1000))
    mesh.add_worker("w", INFO, local(SlowWorker()))
    queue = mesh.submit("a", PROMPTS["r1"], SamplingParams(max_tokens=400, ignore_eos=True))
    assert len((await queue.get()).new_token_ids) == 1
    await asyncio.sleep(0.05)  # steps run; their tokens are held
    assert queue.empty()
    assert mesh.abort("a")
    held = await asyncio.wait_for(queue.get(), 5)
    assert len(held.new_token_ids) > 0 and not held.finished
    await mesh.remove_worker("w")
    # Failover: a dying worker's held tokens reach the caller, the rest come from the other worker.
    reference = await run_mesh(False)
    mesh = Mesh(mesh_config(worker_dead_after_s=0.5, failover_after_s=0.1, stream_interval=4))
    mesh.add_worker("dying", INFO, DeadLink(CountingWorker(), die_after=6))
    mesh.add_worker("healthy", INFO, local(CountingWorker()))
    assert await collect(mesh) == reference
    assert mesh.num_failovers > 0
    await mesh.remove_worker("healthy")
    await mesh.remove_worker("dying")


def test_stream_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream_interval"):
        MeshConfig(stream_interval=0)
