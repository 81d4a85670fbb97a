"""Disaggregated prefill/decode on the Mesh, in process: real SmolLM2 runners behind LocalWorkerLinks,
one prefill worker and one or two decode workers sharing an in-process KV store.

Long prompts are prefilled on the prefill worker and decoded on a decode worker after the KV
handover, direct (the decode worker copies the blocks out of the prefill worker's cache, a shared
memory segment on the CPU: worker_svc/kv_peer.py) or through the store; short ones run whole on a
decode worker. Every greedy token equals the aggregated engine's; a transfer cut, a copy that
fails, a peer whose export does not open, a prefill worker lost and a decode worker lost end in a
recompute, and every block (the prefill side's held ones too) goes back to the free pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from types import SimpleNamespace

import pytest

from llmesh import LLM
from llmesh.kv_store import ThreadedLookup, open_kv_store
from llmesh.local_link import LocalWorkerLink
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.disaggregation import Disaggregation, StepFit, WorkerLoad, load_of
from scheduler_svc.mesh import Connected, LinkBroken, Mesh, MeshConfig
from scheduler_svc.planner import Planner, PlannerConfig
from scheduler_svc.request import Request
from services.sampling_params import SamplingParams
from services.step import StepResult
from worker_svc import kv_peer
from worker_svc.config import WorkerConfig
from worker_svc.pipeline import StepPipeline
from worker_svc.runner import ModelRunner

CHUNK_TOKENS = 32
LONG, SHORT = 150, 20  # 150 tokens: 4 whole 32-token chunks, the tail (22 tokens) computed by decode
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def make_prompts(seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    lengths = [LONG, SHORT, LONG, SHORT, LONG + 9, SHORT + 3]
    return {f"r{seed}-{i}": [rng.randrange(100, 40000) for _ in range(n)] for i, n in enumerate(lengths)}


SEEDS = (1, 2, 3, 4, 5)


def long_prompts(seed: int, n: int) -> dict[str, list[int]]:
    """The first `n` prompts of a seed that are long enough to hand over."""
    return dict([(rid, p) for rid, p in make_prompts(seed).items() if len(p) >= LONG][:n])


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    llm = LLM(kv_cache_memory=32 << 20, enable_prefix_caching=False)
    prompts = {rid: p for seed in SEEDS for rid, p in make_prompts(seed).items()}  # one batch: faster
    outs = llm.generate(list(prompts.values()), GREEDY, use_tqdm=False)
    return {rid: o.outputs[0].token_ids for rid, o in zip(prompts, outs, strict=True)}


class StoreProxy:
    """The shared in-process store as one worker sees it; `cut` makes its loads find nothing
    ("missing") or a corrupt entry ("corrupt"), as a transfer cut short would."""

    def __init__(self, store) -> None:
        self.store, self.cut = store, ""

    def lookup(self, fingerprint, keys):
        return self.store.lookup(fingerprint, keys)

    def put(self, fingerprint, entries):
        return self.store.put(fingerprint, entries)

    def get(self, fingerprint, keys):
        entries = self.store.get(fingerprint, keys)
        if self.cut == "missing" or not entries:
            return []
        if self.cut == "corrupt":
            key, header, payload = entries[0]
            wrong = dataclasses.replace(header, shape=(1, *header.shape))
            return [(key, wrong, payload), *entries[1:]]
        return entries


@pytest.fixture(scope="module")
def pool():
    """A prefill runner and two decode runners (real SmolLM2), one store behind them all."""
    store = open_kv_store("memory:256000000")
    runners = {}
    for wid, role in (("prefill", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
        proxy = StoreProxy(store)
        config = WorkerConfig(kv_cache_memory=32 << 20, kv_chunk_tokens=CHUNK_TOKENS, role=role)
        runners[wid] = (ModelRunner(config, kv_store=proxy), proxy)
    return store, runners


class EmptyStore:
    """A store whose lookups find nothing: a handover waits for its chunks until its timeout."""

    def lookup(self, fingerprint, keys) -> int:
        return 0


class DyingLink(LocalWorkerLink):
    """A worker that dies after `results` step results: its stream breaks and it never answers again."""

    def __init__(self, runner: ModelRunner, results: int) -> None:
        super().__init__(StepPipeline(runner), runner.info, runner.drop_all)
        self.left, self.dead = results, False
        self.max_prompt_chunk = 0  # the most prompt tokens one sequence computed in a plan

    async def send(self, plan) -> None:
        chunks = [s.num_new_tokens for s in (*plan.new_seqs, *plan.scheduled)]
        self.max_prompt_chunk = max([self.max_prompt_chunk, *chunks])
        await super().send(plan)

    async def connect(self, timeout_s: float = 10.0) -> Connected:
        if self.dead:
            raise LinkBroken("the worker is dead")
        return await super().connect(timeout_s)

    async def recv(self) -> StepResult:
        self.left -= 1
        if self.left < 0 or self.dead:
            self.dead = True
            raise LinkBroken("the worker died")
        return await super().recv()


def make_mesh(pool, decoders: int = 1, dies: dict[str, int] | None = None, **config) -> Mesh:
    store, runners = pool
    planner = PlannerConfig(max_num_seqs=8, max_num_batched_tokens=512)
    # The queue rule off unless a test asks (a CPU's prefill queue is seconds long).
    kw = dict(
        disaggregation_threshold=64, handover_timeout_s=5.0, failover_after_s=0.0, worker_dead_after_s=0.3,
        disaggregation_max_queue_s=1e9,
    )  # fmt: skip
    mesh = Mesh(MeshConfig(planner=planner, **{**kw, **config}), kv_store=ThreadedLookup(store))
    for wid in ["prefill", *[f"decode-{i}" for i in range(decoders)]]:
        runner, proxy = runners[wid]
        proxy.cut = ""
        link = DyingLink(runner, (dies or {}).get(wid, 1 << 30))
        mesh.add_worker(wid, runner.info, link)
    return mesh


async def generate_all(mesh: Mesh, prompts: dict[str, list[int]]) -> dict[str, list[int] | Exception]:
    async def one(rid: str, prompt: list[int]) -> list[int] | Exception:
        tokens: list[int] = []
        try:
            async for delta in mesh.generate(rid, prompt, GREEDY):
                tokens.extend(delta.new_token_ids)
        except Exception as e:  # a clean failure (no worker left): the caller's error
            return e
        return tokens

    outs = await asyncio.gather(*(one(rid, p) for rid, p in prompts.items()))
    return dict(zip(prompts, outs, strict=True))


async def settle(mesh: Mesh, timeout_s: float = 20.0) -> None:
    """Until every worker's queued KV work ran and every handover is over."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not mesh.pd.pending and all(s.settled for s in mesh.workers.values()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the mesh did not settle")


def assert_no_leaks(mesh: Mesh) -> None:
    for slot in mesh.workers.values():
        blocks = slot.planner.blocks
        blocks.check_invariants()
        assert not blocks.held, slot.worker_id
        assert blocks.num_free_blocks == blocks.num_blocks, slot.worker_id
    assert not mesh.streams and not mesh.pd.pending and not mesh.pd.holds


async def close(mesh: Mesh) -> None:
    for wid in list(mesh.workers):
        await mesh.remove_worker(wid)


def flush_puts(pool) -> None:
    for runner, _ in pool[1].values():
        runner.kv_tiers.flush(10.0)


@pytest.mark.parametrize("direct", [False, True], ids=["store", "direct"])
async def test_prefill_and_decode_roles_give_the_aggregated_greedy_tokens(pool, reference, direct):
    prompts = make_prompts(1)
    mesh = make_mesh(pool, direct_handover=direct)
    out = await generate_all(mesh, prompts)
    assert out == {rid: reference[rid] for rid in prompts}
    await settle(mesh)
    stats = mesh.stats()
    assert stats["pd_disaggregated"] == stats["pd_handovers"] == 3  # the three long prompts
    assert stats["pd_kept_whole"] == 3 and stats["pd_fallbacks"] == 0
    decode = stats["workers"]["decode-0"]
    assert decode["failed_loads"] == 0
    if direct:  # every block of the long prompts copied from the prefill worker's cache, none loaded
        assert stats["pd_direct"] == 3 and stats["pd_direct_failed"] == 0
        kv_bytes = mesh.workers["decode-0"].info.kv_block_bytes
        blocks = sum(-(-len(p) // 16) for p in prompts.values() if len(p) >= LONG)
        assert stats["pd_direct_bytes"] == blocks * kv_bytes
        assert decode["store_hit_tokens"] == 0
    else:  # the decode worker loaded every whole chunk of the long prompts, computed only the tails
        assert stats["pd_direct"] == 0
        assert decode["store_hit_tokens"] == 3 * 4 * CHUNK_TOKENS
        assert stats["workers"]["prefill"]["store_hit_tokens"] == 0
    assert_no_leaks(mesh)
    await close(mesh)


async def test_a_direct_copy_that_fails_is_recomputed(pool, reference, monkeypatch):
    """The copy raises on the decode worker (worker_svc/kv_peer.py's own tests open a segment that
    is gone, a layout that differs, ids out of range): the decode worker computes the prompt."""

    def broken(*args, **kwargs):
        raise RuntimeError("the copy broke")

    monkeypatch.setattr(kv_peer, "copy_blocks", broken)
    prompts = long_prompts(1, 2)  # the first test's: a new mesh's planners find nothing cached
    mesh = make_mesh(pool)
    out = await generate_all(mesh, prompts)
    assert out == {rid: reference[rid] for rid in prompts}
    await settle(mesh)
    stats = mesh.stats()
    assert stats["pd_direct"] == stats["pd_direct_failed"] == 2 and stats["pd_direct_bytes"] == 0
    assert_no_leaks(mesh)
    await close(mesh)


async def test_a_prefill_worker_gone_before_the_copy_is_planned_ends_in_a_recompute(pool, reference):
    """The decode worker is full, so the handed-over requests wait: one is aborted (its held blocks
    go at once), then the prefill worker leaves (its held blocks with it): nothing copies from it,
    the decode worker computes the other's prompt."""
    prompts = long_prompts(5, 3)
    aborted, *kept = prompts
    mesh = make_mesh(pool)
    prefill, decode = mesh.workers["prefill"], mesh.workers["decode-0"]
    decode.planner.config = dataclasses.replace(decode.planner.config, max_num_seqs=0)  # admits nothing
    tasks = asyncio.gather(generate_all(mesh, prompts))
    deadline = time.monotonic() + 60
    while len(mesh.pd.holds) < len(prompts):
        assert time.monotonic() < deadline, "the handovers were not placed"
        await asyncio.sleep(0.01)
    assert mesh.abort(aborted)
    assert aborted not in mesh.pd.holds and aborted not in prefill.planner.blocks.held
    await mesh.remove_worker("prefill")
    assert not mesh.pd.holds and all(decode.planner.requests[r].peer is None for r in kept)
    decode.planner.config = dataclasses.replace(decode.planner.config, max_num_seqs=8)
    decode.wakeup.set()
    (out,) = await tasks
    assert out[aborted] == reference[aborted][: len(out[aborted])]  # its first token, then the end
    assert {rid: out[rid] for rid in kept} == {rid: reference[rid] for rid in kept}
    await settle(mesh)
    assert mesh.stats()["pd_direct"] == 3 and mesh.stats()["pd_direct_bytes"] == 0
    assert_no_leaks(mesh)
    await close(mesh)


async def test_a_prompt_waiting_for_held_blocks_runs_once_they_are_copied(pool):
    """The prefill worker's cache (45 blocks) holds two handed-over prompts (19 blocks each) until
    the decode worker copies them; a third waits for blocks meanwhile, and runs once the copies
    free them (the freed hold wakes the prefill worker: nothing else would)."""
    rng = random.Random(9)
    prompts = {f"held-{i}": [rng.randrange(100, 40000) for _ in range(300)] for i in range(3)}
    mesh = make_mesh(pool)
    mesh.kv_store = None
    prefill, decode = mesh.workers["prefill"], mesh.workers["decode-0"]
    decode.planner.config = dataclasses.replace(decode.planner.config, max_num_seqs=0)  # admits nothing
    tasks = asyncio.gather(generate_all(mesh, prompts))
    deadline = time.monotonic() + 60
    while len(mesh.pd.holds) < 2:
        assert time.monotonic() < deadline, "the handovers were not placed"
        await asyncio.sleep(0.01)
    assert prefill.planner.num_waiting == 1  # no blocks for the third
    decode.planner.config = dataclasses.replace(decode.planner.config, max_num_seqs=8)
    decode.wakeup.set()
    (out,) = await asyncio.wait_for(tasks, 60)
    assert all(len(tokens) == MAX_TOKENS for tokens in out.values()), out
    await settle(mesh)
    assert mesh.stats()["pd_direct"] == 3
    assert_no_leaks(mesh)
    await close(mesh)


@pytest.mark.parametrize("cut", ["missing", "corrupt"])
async def test_a_cut_transfer_is_recomputed_by_the_decode_worker(pool, reference, cut):
    prompts = make_prompts(2 if cut == "missing" else 3)
    mesh = make_mesh(pool, direct_handover=False)
    pool[1]["decode-0"][1].cut = cut
    out = await generate_all(mesh, prompts)
    assert out == {rid: reference[rid] for rid in prompts}
    await settle(mesh)
    stats = mesh.stats()
    assert stats["pd_handovers"] == 3
    assert stats["workers"]["decode-0"]["failed_loads"] == 3  # each long prompt's load failed
    assert_no_leaks(mesh)
    await close(mesh)


async def test_a_prefill_worker_lost_mid_transfer_ends_in_a_recompute(pool, reference):
    prompts = make_prompts(4)
    # The prefill worker dies after its first step: some prompts mid-prefill, some handed over.
    mesh = make_mesh(pool, dies={"prefill": 1})
    out = await generate_all(mesh, prompts)
    assert out == {rid: reference[rid] for rid in prompts}
    await settle(mesh)
    assert "prefill" not in mesh.workers
    assert mesh.stats()["failovers"] + mesh.stats()["pd_fallbacks"] >= 1
    assert_no_leaks(mesh)
    await close(mesh)


async def test_a_decode_worker_lost_moves_its_requests_to_another(pool, reference):
    flush_puts(pool)
    prompts = make_prompts(5)
    mesh = make_mesh(pool, decoders=2, dies={"decode-0": 3})
    out = await generate_all(mesh, prompts)
    assert out == {rid: reference[rid] for rid in prompts}
    await settle(mesh)
    assert "decode-0" not in mesh.workers and mesh.stats()["failovers"] >= 1
    assert_no_leaks(mesh)
    await close(mesh)


async def test_the_queue_rule_keeps_a_long_prompt_local_in_bounded_chunks(pool, reference):
    """The prefill worker measured slow (0.1 s a token): the first long prompt finds its queue empty
    and goes there; the second finds the first queued there (15 s predicted) and stays on the
    decode worker, computed in chunks of 32 tokens beside the decodes; the third finds that worker
    busy with it and goes to the prefill worker. Every token is the aggregated engine's."""
    prompts = make_prompts(1)
    mesh = make_mesh(pool, disaggregation_max_queue_s=0.5, disaggregation_local_chunk_tokens=32)
    mesh.kv_store = None  # direct handovers only: the store holds these prompts from the tests before
    mesh.workers["prefill"].step_fit.samples.extend([(100, 10.0), (200, 20.0)])
    out = await generate_all(mesh, prompts)
    assert out == {rid: reference[rid] for rid in prompts}
    await settle(mesh)
    stats = mesh.stats()
    assert stats["pd_decisions"] == {
        "prefill/queue_short": 1, "decode/queue_long": 1, "prefill/decode_busy": 1, "decode/short_prompt": 3
    }  # fmt: skip
    assert stats["pd_disaggregated"] == stats["pd_handovers"] == 2
    decode = mesh.workers["decode-0"]
    assert decode.planner.config.long_prefill_token_threshold == 32
    assert decode.link.max_prompt_chunk == 32  # the kept prompt's chunks, bounded
    assert mesh.workers["prefill"].link.max_prompt_chunk >= LONG  # a prefill worker's are not
    assert_no_leaks(mesh)
    await close(mesh)


async def test_an_abort_between_the_workers_ends_the_stream(pool):
    """A request aborted while its KV is on its way: the caller gets the end, nothing is left."""
    prompts = make_prompts(6)
    mesh = make_mesh(pool, handover_timeout_s=30.0, direct_handover=False)
    mesh.kv_store = ThreadedLookup(EmptyStore())
    rid, prompt = next(iter(prompts.items()))
    queue = mesh.submit(rid, prompt, GREEDY)
    first = await asyncio.wait_for(queue.get(), 60)
    assert len(first.new_token_ids) == 1 and not first.finished
    await asyncio.sleep(0.05)
    assert mesh.pd.pending[rid].task is not None  # waiting for chunks that never come
    assert mesh.abort(rid)
    last = await asyncio.wait_for(queue.get(), 5)
    assert last.finished and last.finish_reason == "abort"
    await settle(mesh)
    assert_no_leaks(mesh)
    await close(mesh)


# ----- the routing rules alone (no model) -----
def _slot(wid: str, role: str) -> SimpleNamespace:
    return SimpleNamespace(worker_id=wid, info=SimpleNamespace(role=role))


def test_pools_keep_prefill_workers_off_decode_unless_they_are_all_there_is():
    pd = Disaggregation(threshold=64, timeout_s=1.0)
    p, d, b = _slot("p", "prefill"), _slot("d", "decode"), _slot("b", "both")
    assert pd.pools([p, d, b]) == ([d, b], [p])
    old = _slot("old", "")  # a worker from before roles: both
    assert pd.pools([b, old]) == ([b, old], [])
    assert pd.pools([p]) == ([p], [])  # prefill workers alone serve whole requests


def test_only_plain_long_generations_are_disaggregated():
    pd = Disaggregation(threshold=64, timeout_s=1.0)

    def req(n: int, **params) -> Request:
        return Request("r", list(range(3, 3 + n)), SamplingParams(**{"max_tokens": 8, **params}))

    assert pd.wants(req(100), 100, chunk_blocks=2, has_store=True)
    assert not pd.wants(req(100), 63, chunk_blocks=2, has_store=True)  # the decode worker has the rest
    assert pd.stats.kept_whole == 1
    assert not pd.wants(req(100), 100, chunk_blocks=2, has_store=False)  # nothing to hand over through
    assert not pd.wants(req(100), 100, chunk_blocks=0, has_store=True)
    assert not pd.wants(req(100, max_tokens=1), 100, chunk_blocks=2, has_store=True)
    assert not pd.wants(req(100, prompt_logprobs=1), 100, chunk_blocks=2, has_store=True)
    moved = req(100)
    moved.output_token_ids = [5]
    assert not pd.wants(moved, 100, chunk_blocks=2, has_store=True)  # a failover continues where it is


def test_a_prefill_side_request_gets_its_callers_params_back():
    pd = Disaggregation(threshold=64, timeout_s=1.0)
    sp = SamplingParams(max_tokens=50, min_tokens=5)
    req = Request("r", [3, 4, 5], sp)
    pd.send_to_prefill(req, "p")
    assert req.sampling_params.max_tokens == 1 and req.sampling_params.min_tokens == 1
    assert pd.restore(req).sampling_params is sp and not pd.pending


# ----- the queue rule alone (no model) -----
FIT = (0.01, 0.001)  # a step: 10 ms + 1 ms a prompt token


def test_the_queue_rule_sends_to_prefill_while_its_queue_is_short():
    pd = Disaggregation(threshold=64, timeout_s=1.0, max_queue_s=0.1)
    decode = WorkerLoad(0, fit=FIT, step_tokens=32, chunk_bounded=True)
    assert pd.remote(400, WorkerLoad(0, fit=FIT, step_tokens=512), decode)  # no queue at all
    # 50 tokens queued (60 ms) and the end of a plan in flight (310 ms predicted, 290 ms run).
    short = WorkerLoad(50, 300, 0.29, FIT, 512)
    assert short.wait_s() == pytest.approx(0.08)
    assert pd.remote(400, short, decode)
    assert pd.stats.decisions == {"prefill/queue_short": 2}
    # Until the prefill worker's steps are measured nothing is predicted: it goes there.
    assert pd.remote(400, WorkerLoad(5000), decode)
    assert pd.stats.decisions["prefill/unmeasured"] == 1


def test_the_queue_rule_keeps_local_when_the_predicted_wait_is_long():
    pd = Disaggregation(threshold=64, timeout_s=1.0, max_queue_s=0.1)
    # 1,000 tokens queued and a 300-token plan in flight for 0.1 s: 1.23 s before a prompt starts.
    busy = WorkerLoad(1000, 300, 0.1, FIT, 512)
    assert busy.wait_s() == pytest.approx(1.23)
    decode = WorkerLoad(40, fit=FIT, step_tokens=32, chunk_bounded=True)
    assert not pd.remote(400, busy, decode)  # 13 chunks: 0.57 s there against 1.64 s
    assert pd.last_prediction == pytest.approx((1.23, 1.64, 0.57))
    # Not if the decode worker computes a long prompt already, or its chunks are not bounded,
    # or it would still be slower (its fixed step cost, 0.5 s, is 13 times over 1.64 s).
    assert pd.remote(400, busy, dataclasses.replace(decode, long_prefilling=True))
    assert pd.remote(400, busy, dataclasses.replace(decode, chunk_bounded=False))
    assert pd.remote(400, busy, dataclasses.replace(decode, fit=(0.5, 0.001)))
    # A decode worker not measured yet (or flat: decode-bound steps) is predicted at the prefill
    # worker's rate per token.
    assert not pd.remote(400, busy, dataclasses.replace(decode, fit=None))
    assert not pd.remote(400, busy, dataclasses.replace(decode, fit=(0.01, 0.0)))
    assert pd.stats.decisions == {
        "decode/queue_long": 3, "prefill/decode_busy": 1, "prefill/decode_unbounded": 1,
        "prefill/prefill_faster": 1,
    }  # fmt: skip


def test_a_workers_load_is_its_prompt_tokens_not_yet_planned():
    blocks = BlockManager(64, 16, b"fp", True)
    config = PlannerConfig(8, 256, max_model_len=512, long_prefill_token_threshold=32)
    planner = Planner(config, blocks)
    sp = SamplingParams(max_tokens=4)
    planner.add_request(Request("long", list(range(3, 203)), sp))
    planner.add_request(Request("short", list(range(3, 23)), sp))
    handed = Request("handed", list(range(300, 400)), sp)
    handed.handed_over = True  # its prompt is copied or loaded: no queued prefill
    planner.add_request(handed)
    load = load_of(planner, 0, 0.0, StepFit(), long_tokens=64)
    assert (load.queued_tokens, load.long_prefilling, load.chunk_bounded) == (220, True, True)
    assert load.step_tokens == 32 and load.fit is None
    plan = planner.schedule()  # a bounded chunk of each: the long prompt's first 32 tokens
    load = load_of(planner, plan.num_tokens, 0.0, StepFit(), long_tokens=64)
    assert (load.queued_tokens, load.long_prefilling) == (200 - 32, True)
    unbounded = Planner(PlannerConfig(8, 256, max_model_len=512), BlockManager(64, 16, b"fp", True))
    assert not load_of(unbounded, 0, 0.0, StepFit(), 64).chunk_bounded


def test_a_step_fit_is_not_thrown_by_a_slow_step():
    """A first step that compiled kernels (2 s for 4,096 tokens) among steps of 10 ms + 20 us a
    token: the medians keep the line; least squares would have put 2 s into the fixed part."""
    fit = StepFit()
    assert fit.coefficients() is None
    fit.samples.append((4096, 2.0))
    for n in (4096, 5000, 6000, 7000, 8192, 4500):
        fit.samples.append((n, 0.01 + 20e-6 * n))
    a, b = fit.coefficients()
    assert a == pytest.approx(0.01) and b == pytest.approx(20e-6)
    flat = StepFit()  # decode-bound steps: time does not grow with their few prompt tokens
    flat.samples.extend([(40, 0.007), (300, 0.006), (120, 0.0065)])
    assert flat.coefficients() == (0.0065, 0.0)
