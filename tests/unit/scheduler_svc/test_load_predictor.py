"""The KV load predictor's decision rules: load a store hit only as far as it beats recompute."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.kv_tiers import KVTierPlanner
from scheduler_svc.load_predictor import ERROR_BOUNDS, PROBE_EVERY, LinearFit, LoadDecision, LoadPredictor
from scheduler_svc.mesh import Mesh, MeshConfig
from scheduler_svc.planner import PlannerConfig
from scheduler_svc.request import Request
from services.sampling_params import SamplingParams
from services.step import KVTransfers, NewSequence, StepPlan, StepResult, StoreLoad
from tests.unit.scheduler_svc.test_mesh import INFO, local, mesh_config
from tests.unit.scheduler_svc.test_planner import CountingWorker

BS = 16  # tokens per block
C = 4  # blocks per chunk


def predictor(load_s_per_block: float, prefill_s_per_token: float, overhead_s: float = 0.0) -> LoadPredictor:
    """A predictor that has measured loads and prefills of these rates."""
    p = LoadPredictor(BS)
    for blocks in (4, 16, 64):
        p.observe_load(blocks, blocks * 1000, overhead_s + blocks * load_s_per_block)
    for tokens in (64, 256, 1024):
        p.observe_prefill(tokens, 0.002 + tokens * prefill_s_per_token)
    return p


def test_the_fits_recover_overhead_and_rate():
    fit = LinearFit()
    for x in (1, 10, 100):
        fit.add(x, 0.5 + 0.25 * x)
    a, b = fit.coefficients()
    assert a == pytest.approx(0.5) and b == pytest.approx(0.25)
    same_x = LinearFit()
    same_x.add(8, 4.0)
    same_x.add(8, 4.0)
    assert same_x.coefficients() == (0.0, 0.5)  # no spread: through the origin
    flat = LinearFit(flat_without_slope=True)
    for x, y in ((32, 0.019), (288, 0.018), (32, 0.017), (288, 0.018)):  # noise over any slope
        flat.add(x, y)
    assert flat.coefficients() == (pytest.approx(0.018), 0.0)  # the fixed cost, no rate
    p = predictor(1e-4, 1e-5, overhead_s=0.001)
    assert p.load_seconds(10) == pytest.approx(0.002)
    assert p.compute_seconds(100) == pytest.approx(0.001)  # the marginal part only
    assert p.bytes_per_second == pytest.approx(1000 / 1e-4)
    assert p.prefill_tokens_per_second == pytest.approx(1e5)


def test_a_load_faster_than_recompute_is_loaded_whole():
    p = predictor(load_s_per_block=1e-5, prefill_s_per_token=1e-5)  # a block loads 16x faster
    d = p.decide(C, [C] * 8)
    assert d.chunks == 8 and d.skipped_blocks == 0
    assert d.predicted_seconds == pytest.approx(32 * 1e-5)


def test_a_load_slower_than_recompute_is_skipped_and_probed_only_where_the_probe_costs_little():
    p = predictor(load_s_per_block=1e-3, prefill_s_per_token=1e-5)  # a block loads 6x slower
    # A chunk's probe loses 3.4 ms: on a 512-token prompt (7 ms of prefill) never, however due.
    decisions = [p.decide(C, [C] * 8) for _ in range(2 * PROBE_EVERY)]
    assert all(d.chunks == 0 and d.skipped_blocks == 32 for d in decisions)
    probe = p.decide(C, [C] * 8, compute_tokens=8000)  # 82 ms of prefill: 3.4 ms is 4 %
    assert probe.chunks == 1 and probe.skipped_blocks == 28  # one chunk to measure the path again
    assert p.decide(C, [C] * 8, compute_tokens=8000).chunks == 0  # the next one is not due yet


def test_a_fixed_overhead_makes_short_hits_computed_and_long_ones_loaded():
    # 5 ms to start a load, then 10x faster than computing: worth it past ~32 blocks.
    p = predictor(load_s_per_block=1.6e-5, prefill_s_per_token=1e-5, overhead_s=0.005)
    assert p.decide(C, [C] * 2).chunks == 0  # 128 tokens: 1.28 ms of prefill < 5.1 ms
    assert p.decide(C, [C] * 64).chunks == 64  # 4096 tokens: 41 ms of prefill > 9 ms


def test_a_partial_first_chunk_counts_only_the_blocks_it_fills():
    p = predictor(load_s_per_block=1e-4, prefill_s_per_token=1e-5)  # 0.4 ms per chunk loaded
    # The first chunk fills 1 block (0.16 ms of prefill): not worth its 0.4 ms; the whole hit is.
    assert p.decide(C, [1]).chunks == 0
    assert p.decide(C, [1, C, C, C]).chunks == 4


def test_unmeasured_paths_start_conservatively():
    fresh = LoadPredictor(BS)
    assert fresh.decide(C, [C] * 8).chunks == 8  # no prefill measured: nothing to compare with
    fresh.observe_prefill(256, 0.01)
    probe = fresh.decide(C, [C] * 8)
    assert probe.chunks == 1 and probe.predicted_seconds is None  # an unmeasured path: one chunk
    # With the worker's block size a prior bandwidth predicts: 1 MB blocks at 1 GB/s, 1 ms each.
    prior = LoadPredictor(BS, block_bytes=1_000_000, prior_bytes_per_s=1e9)
    prior.observe_prefill(256, 0.256)  # 1 ms a token: a block (16 tokens) computes in 16 ms
    assert prior.decide(C, [C] * 8) == LoadDecision(8, pytest.approx(0.032), 0)
    prior.observe_prefill(512, 0.256 + 256e-5)  # ... now 10 us a token: a block computes in 0.16 ms
    assert prior.decide(C, [C] * 8).chunks == 1  # the prior says no: a probe
    off = LoadPredictor(BS, enabled=False)
    off.observe_prefill(256, 0.01)
    assert off.decide(C, [C] * 8).chunks == 8


def _request(rid: str, tokens: int, store_blocks: int) -> Request:
    req = Request(rid, list(range(1, tokens + 1)), SamplingParams(max_tokens=1), [])
    req.store_hit_blocks = store_blocks
    return req


def test_the_planner_loads_only_the_predicted_part_and_counts_the_prediction():
    blocks = BlockManager(256, BS, b"fp", True)
    tiers = KVTierPlanner(blocks, 0, C, predictor(load_s_per_block=1e-3, prefill_s_per_token=1e-5))
    req = _request("slow", 40 * BS, 32)
    hit = tiers.find(req, [bytes([i]) for i in range(40)], 0, 39)
    assert hit.store_end == hit.store_start == 0  # computed
    tiers.admit(req, list(range(39)), 0, hit)
    assert tiers.stats.kv_load_skipped == 1 and tiers.stats.kv_load_skipped_tokens == 32 * BS
    assert not tiers.finish_plan(1, []).store_loads

    tiers.predictor = predictor(load_s_per_block=1e-6, prefill_s_per_token=1e-5)
    req = _request("fast", 40 * BS, 32)
    hit = tiers.find(req, [bytes([i]) for i in range(40)], 0, 39)
    assert (hit.store_start, hit.store_end) == (0, 32)
    tiers.admit(req, list(range(39)), 0, hit)
    kv = tiers.finish_plan(2, [])
    assert len(kv.store_loads) == 1 and len(kv.store_loads[0].keys) == 8
    assert tiers.stats.kv_load_predictions == 1
    predicted = tiers.stats.kv_load_predicted_seconds
    assert predicted == pytest.approx(32e-6)

    # The worker's report: the error lands in its bucket, the fit learns from it.
    plan = StepPlan(2, [NewSequence("fast", [], 0, [], 32 * BS, 8 * BS, SamplingParams())], kv=kv)
    result = StepResult(
        2, kv_load_blocks=[32], kv_load_bytes=[32 * 1000], kv_load_seconds=[predicted + 0.003]
    )
    tiers.observe(plan, result, predicted + 0.003 + 0.002 + 8 * BS * 1e-5)  # the load, then its tail
    stats = tiers.stats
    assert sum(stats.kv_load_error_counts) == 1
    assert stats.kv_load_error_counts[ERROR_BOUNDS.index(0.005)] == 1
    assert stats.kv_load_error_seconds == pytest.approx(0.003)
    assert stats.kv_load_bytes_per_second > 0 and stats.kv_prefill_tokens_per_second > 0


def test_a_hit_far_past_the_measured_sizes_gets_a_larger_probe_before_it_is_skipped():
    p = LoadPredictor(BS)
    p.observe_prefill(256, 0.0026)  # 1e-5 s per token
    p.observe_load(C, 4000, 0.0012)  # one chunk: 1.2 ms (overhead and rate unknown apart)
    # Through the origin 32 chunks would take 38 ms against 20 ms of prefill: a probe of 2 chunks.
    assert p.decide(C, [C] * 32).chunks == 2
    p.observe_load(2 * C, 8000, 0.0014)  # 1 ms of overhead, 0.05 ms a block: now it is clear
    assert p.decide(C, [C] * 32).chunks == 32
    assert p.decide(C, [C] * 4).chunks == 4  # within 4x of what was measured: as the fit says
    assert p.decide(C, [C] * 2).chunks == 0  # 1.4 ms to load, 1.28 ms to compute
    assert p.decide(C, [C]).chunks == 0  # a short hit: 1.2 ms to load, 0.64 ms to compute


def test_a_request_that_no_hit_could_pay_for_skips_the_lookup_and_probes_only_a_long_one():
    p = predictor(load_s_per_block=1e-3, prefill_s_per_token=1e-5)
    assert not any(p.worth_looking(C, 8) for _ in range(2 * PROBE_EVERY))  # short: never a lookup
    assert p.worth_looking(C, 8, compute_tokens=8000)  # the due probe, where it costs 4 %
    assert p.decide(C, [C] * 8).chunks == 1  # the lookup that went ahead loads one chunk
    assert not p.worth_looking(C, 8, compute_tokens=8000)  # the next one is not due yet
    assert predictor(load_s_per_block=1e-5, prefill_s_per_token=1e-5).worth_looking(C, 8)
    assert LoadPredictor(BS).worth_looking(C, 8)  # nothing measured: look
    close = predictor(load_s_per_block=1e-4, prefill_s_per_token=1e-5)  # 0.4 ms to save 0.64 per chunk
    assert close.worth_looking(C, 1)
    close.observe_lookup(0.0005)  # ... but the lookup itself waits 0.5 ms
    assert not close.worth_looking(C, 1)
    assert close.worth_looking(C, 8)  # 3.2 ms to save 5.1


def test_chunks_computed_instead_of_loaded_are_not_put_back():
    blocks = BlockManager(256, BS, b"fp", True)
    tiers = KVTierPlanner(blocks, 0, C, predictor(load_s_per_block=1e-3, prefill_s_per_token=1e-5))
    req = _request("slow", 40 * BS, 32)
    keys = [bytes([i]) for i in range(40)]
    hit = tiers.find(req, keys, 0, 39)
    tiers.admit(req, list(range(39)), 0, hit)
    assert all(keys[(k + 1) * C - 1] in tiers._in_store for k in range(8))


def test_a_step_after_a_load_is_a_prefill_sample_of_its_tail():
    blocks = BlockManager(256, BS, b"fp", True)
    tiers = KVTierPlanner(blocks, 0, C, LoadPredictor(BS))
    full = StepPlan(1, [NewSequence("a", [], 0, [], 0, 288, SamplingParams())])
    tiers.observe(full, StepResult(1), 0.033)  # 288 tokens computed: 33 ms
    assert tiers.predictor.compute_seconds(256) == pytest.approx(0.033 * 256 / 288)  # through 0
    kv = KVTransfers(store_loads=[StoreLoad("b", [b"k"], list(range(C)))])
    tail = StepPlan(2, [NewSequence("b", [], 0, [], 256, 32, SamplingParams())], kv=kv)
    result = StepResult(2, kv_load_blocks=[C], kv_load_bytes=[C * 1000], kv_load_seconds=[0.012])
    tiers.observe(tail, result, 0.032)  # 12 ms of load, then 32 tokens in 20 ms
    assert tiers.predictor.compute_seconds(256) == pytest.approx(0.013 * 256 / 256)  # 50 us a token
    failed = StepResult(
        3, failed_load_seq_ids=["c"], kv_load_blocks=[0], kv_load_bytes=[0], kv_load_seconds=[0.01]
    )
    tiers.observe(StepPlan(3, [NewSequence("c", [], 0, [], 256, 32, SamplingParams())], kv=kv), failed, 0.5)
    assert tiers.predictor.compute_seconds(256) == pytest.approx(0.013)  # not a clean sample


class GatedLookup:
    """A KV store that holds every chunk asked about, counts its lookups, and answers one whose
    chain is longer than `gate_chunks` only once `gate` is set (a slow store)."""

    def __init__(self, gate_chunks: int) -> None:
        self.calls = 0
        self.gate_chunks = gate_chunks
        self.gate = asyncio.Event()

    async def lookup(self, fingerprint: bytes, keys: list[bytes]) -> int:
        self.calls += 1
        if len(keys) > self.gate_chunks:
            await self.gate.wait()
        return len(keys)


async def test_a_skipped_prompt_never_waits_for_the_store_and_a_lookup_holds_back_no_other_prompt():
    info = dataclasses.replace(INFO, kv_chunk_blocks=C)  # 8-token blocks: 32-token chunks
    store = GatedLookup(gate_chunks=4)
    mesh = Mesh(mesh_config(), kv_store=store)
    mesh.add_worker("w", info, local(CountingWorker()))
    tiers = mesh.workers["w"].planner.tiers
    # A path that loses 0.8 ms a chunk (4 ms to load 3.2 ms of prefill); prefill 2 ms + 0.1 ms a
    # token, as measured (the counting worker's microsecond steps are not fed to it).
    p = tiers.predictor = LoadPredictor(8)
    for blocks in (4, 16, 64):
        p.observe_load(blocks, blocks * 1000, blocks * 1e-3)
    for tokens in (64, 256):
        p.observe_prefill(tokens, 0.002 + tokens * 1e-4)
    p.observe_prefill = lambda tokens, seconds: None  # type: ignore[method-assign]

    async def first_token(i: int, n: int) -> None:  # prompts apart from their first token on
        prompt = [i + 8] + [(i + 7 * j) % 90 + 8 for j in range(n - 1)]
        async for _ in mesh.generate(f"r{i}", prompt, SamplingParams(max_tokens=1)):
            pass

    # 100-token prompts (12 ms of prefill, a probe would add 7 %): never a lookup, due or not; each
    # is peeked at once its token is out (the peek's answer spares its puts, nobody waits for it).
    for i in range(2 * PROBE_EVERY):
        await first_token(i, 100)
    await asyncio.sleep(0.01)
    assert store.calls == 2 * PROBE_EVERY and tiers.stats.kv_lookups_skipped == 2 * PROBE_EVERY
    # A 480-token prompt (50 ms): the due probe looks it up. While the store is slow to answer,
    # a short prompt behind it gets its token.
    long = asyncio.create_task(first_token(80, 480))
    await asyncio.sleep(0.01)
    assert store.calls == 2 * PROBE_EVERY + 1 and not long.done()
    await asyncio.wait_for(first_token(81, 100), 5)
    assert not long.done()
    store.gate.set()
    await asyncio.wait_for(long, 5)
    assert tiers.stats.store_hit_tokens == 32  # the probe: one chunk, the rest computed
    await mesh.remove_worker("w")


class PeekedStore:
    """A KV store whose lookups answer only once `gate` is set: the first says it holds every
    chunk asked about, the later ones none."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate = asyncio.Event()

    async def lookup(self, fingerprint: bytes, keys: list[bytes]) -> int:
        self.calls += 1
        first = self.calls == 1
        await self.gate.wait()
        return len(keys) if first else 0


class PutRecorder(CountingWorker):
    def __init__(self) -> None:
        super().__init__()
        self.puts: list[bytes] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.puts += [p.key for p in plan.kv.store_puts]
        return super().execute(plan)


async def test_a_skipped_prompt_is_peeked_at_after_its_token_and_what_the_store_holds_is_not_put():
    info = dataclasses.replace(INFO, kv_chunk_blocks=C)  # 8-token blocks: 32-token chunks
    store, worker = PeekedStore(), PutRecorder()
    planner = PlannerConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512)
    mesh = Mesh(MeshConfig(planner=planner), kv_store=store)
    mesh.add_worker("w", info, local(worker))
    slot = mesh.workers["w"]
    slot.planner.tiers.predictor = predictor(load_s_per_block=1.0, prefill_s_per_token=1e-5)  # skip

    async def first_token(i: int) -> None:  # 100 tokens: 3 whole chunks, one prefill step
        prompt = [(i * 11 + 7 * j) % 90 + 8 for j in range(100)]
        async for _ in mesh.generate(f"r{i}", prompt, SamplingParams(max_tokens=1)):
            pass

    async def settled() -> None:
        while not slot.settled:
            await asyncio.sleep(0.001)

    # The token comes while the store has not answered: nothing waited for it, nothing was put.
    await asyncio.wait_for(first_token(0), 5)
    await asyncio.sleep(0.01)
    assert store.calls == 1 and worker.puts == [] and not slot.settled
    store.gate.set()  # it holds the 3 chunks: none is put
    await asyncio.wait_for(settled(), 5)
    assert worker.puts == [] and slot.planner.tiers.puts_spared == 3
    await asyncio.wait_for(first_token(1), 5)  # the store holds none of these: all 3 are put
    await asyncio.wait_for(settled(), 5)
    assert store.calls == 2 and len(worker.puts) == 3 and slot.planner.tiers.puts_spared == 3
    mesh.submit("r2", [9] * 100, SamplingParams(max_tokens=1))
    assert "r2" in mesh._peeks_due
    mesh.abort("r2")  # ended before its first token: never peeked, nothing left behind
    assert not mesh._peeks_due
    await asyncio.wait_for(settled(), 5)
    await mesh.remove_worker("w")


def test_a_peek_holds_puts_back_only_from_plans_that_compute_nothing():
    tiers = KVTierPlanner(BlockManager(64, BS, b"fp", True), 0, 1, LoadPredictor(BS))
    tiers._pending_puts = [(b"a", [0]), (b"b", [1])]
    tiers.peek_started()
    assert tiers.peeking and not tiers.has_pending()
    assert not tiers.finish_plan(1, [], runs_forward=False).store_puts  # waits for the answer
    tiers.peek_done([b"a"])  # the store holds a
    assert tiers.has_pending()
    assert [p.key for p in tiers.finish_plan(2, [], runs_forward=False).store_puts] == [b"b"]
    assert tiers.puts_spared == 1
    tiers._pending_puts = [(b"c", [2])]
    tiers.peek_started()  # a forward could overwrite c's blocks: a plan that computes takes it
    assert [p.key for p in tiers.finish_plan(3, []).store_puts] == [b"c"]


def test_puts_wait_for_the_plan_in_flight_instead_of_riding_ahead_of_its_tokens():
    blocks = BlockManager(64, BS, b"fp", True)
    tiers = KVTierPlanner(blocks, 0, 1, LoadPredictor(BS))
    tiers.finish_plan(1, [])  # a prefill, running
    tiers._pending_puts = [(b"k", [0])]  # a chunk it made full
    assert not tiers.has_pending()  # no plan of their own while plan 1 runs ...
    assert not tiers.finish_plan(
        2, [], runs_forward=False
    ).store_puts  # ... nor a ride on one that computes nothing
    tiers.executed(1, [])
    tiers.executed(2, [])
    assert tiers.has_pending()  # its tokens are in: now
    assert [p.key for p in tiers.finish_plan(3, [], runs_forward=False).store_puts] == [b"k"]
    tiers.finish_plan(4, [])  # a plan that computes carries them at once, as before
    tiers._pending_puts = [(b"k2", [1])]
    assert [p.key for p in tiers.finish_plan(5, []).store_puts] == [b"k2"]


def test_a_fresh_workers_slow_first_step_does_not_tilt_the_prefill_fit():
    p = LoadPredictor(BS)
    p.observe_prefill(256, 2.0)  # kernels loaded on first use: 2 s where its peers took 30 ms
    for _ in range(12):
        p.observe_prefill(256, 0.030)
    p.observe_prefill(32, 0.025)  # a tail after a load
    p.observe_load(16, 16 * 1000, 0.016)
    assert p.compute_seconds(256) == pytest.approx(0.005 * 256 / 224)  # 177 ms with the outlier
    assert p.decide(16, [16], compute_tokens=288).chunks == 0
    p.observe_prefill(8448, 0.23)  # a new size, alone: counts, however slow beside the rest
    assert (8448, 0.23) in p.prefill.inliers()
    assert p.compute_seconds(8192) > 0.15


def test_a_step_whose_time_is_its_fixed_cost_loads_nothing():
    p = LoadPredictor(BS)
    for tokens, seconds in ((288, 0.018), (32, 0.019), (288, 0.0185), (32, 0.0175)):  # eager launches
        p.observe_prefill(tokens, seconds)
    p.observe_load(C, C * 1000, 0.013)
    assert p.compute_seconds(256) == 0.0
    assert p.decide(C, [C], compute_tokens=288).chunks == 0  # through 0 it was ~60 us a token: a load
