"""Planner behaviour against a tiny deterministic worker that keeps state the way the runner does."""

import random

import pytest

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.planner import Planner, PlannerConfig, RequestRejected
from scheduler_svc.request import FinishReason, Request
from services.sampling_params import SamplingParams
from services.step import StepPlan, StepResult


class CountingWorker:
    """Next token = a function of the whole sequence so far, so any mistake in replay shows."""

    def __init__(self) -> None:
        self.seqs: dict[str, dict] = {}
        self.max_tokens_seen = 0
        self.max_seqs_seen = 0

    def execute(self, plan: StepPlan) -> StepResult:
        for sid in plan.finished_ids + plan.preempted_ids:
            self.seqs.pop(sid)
        for s in plan.new_seqs:
            assert s.seq_id not in self.seqs
            self.seqs[s.seq_id] = {"tokens": list(s.token_ids), "done": s.num_computed_tokens}
        order = [(s.seq_id, s.num_new_tokens) for s in plan.new_seqs + plan.scheduled]
        self.max_tokens_seen = max(self.max_tokens_seen, plan.num_tokens)
        self.max_seqs_seen = max(self.max_seqs_seen, plan.num_seqs)
        res = StepResult(plan.step_id)
        for sid, n in order:
            st = self.seqs[sid]
            st["done"] += n
            assert st["done"] <= len(st["tokens"])
            if st["done"] == len(st["tokens"]):
                tok = (sum(st["tokens"]) * 31 + len(st["tokens"])) % 97 + 3
                st["tokens"].append(tok)
                res.seq_ids.append(sid)
                res.token_ids.append(tok)
                res.logprobs.append(None)
        return res


def run(planner: Planner, worker: CountingWorker, max_steps: int = 10_000) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not planner.has_unfinished():
            break
        plan = planner.schedule()
        for d in planner.update(plan, worker.execute(plan)):
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
        planner.blocks.check_invariants()
    assert not planner.has_unfinished()
    return out


def workload(seed: int = 0, n: int = 12) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 90) for _ in range(40)]
    reqs = []
    for i in range(n):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, 90) for _ in range(rng.randint(5, 60))]
        reqs.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(5, 30), ignore_eos=True)))
    return reqs


def make(num_blocks: int, prefix_caching: bool = True, **cfg) -> Planner:
    blocks = BlockManager(num_blocks, 8, b"t", enable_prefix_caching=prefix_caching)
    return Planner(PlannerConfig(max_model_len=512, **cfg), blocks)


def test_same_outputs_under_kv_pressure_and_small_chunks():
    p = make(400)
    for r in workload():
        p.add_request(r)
    ref = run(p, CountingWorker())
    assert p.num_preemptions == 0
    tight = make(24, max_num_batched_tokens=32, long_prefill_token_threshold=16)
    for r in workload():
        tight.add_request(r)
    worker = CountingWorker()
    got = run(tight, worker)
    assert got == ref
    assert tight.num_preemptions > 0
    assert worker.max_tokens_seen <= 32
    assert tight.blocks.num_free_blocks == 24


def test_limits_per_step():
    p = make(400, max_num_seqs=3, max_num_batched_tokens=50)
    for r in workload():
        p.add_request(r)
    worker = CountingWorker()
    run(p, worker)
    assert worker.max_seqs_seen <= 3 and worker.max_tokens_seen <= 50


def test_prefix_hits_are_counted_and_change_nothing():
    p = make(400, prefix_caching=False)
    for r in workload():
        p.add_request(r)
    cold = run(p, CountingWorker())
    p = make(400, max_num_seqs=1)  # one at a time, so later requests find the shared prefix cached
    for r in workload():
        p.add_request(r)
    warm = run(p, CountingWorker())
    assert warm == cold
    assert p.blocks.stats.hits >= 5 * 40 // 8 * 8


def test_abort_at_any_point_frees_blocks():
    for stop_after in range(0, 30, 3):
        p = make(60)
        for r in workload(1):
            p.add_request(r)
        worker = CountingWorker()
        for _ in range(stop_after):
            plan = p.schedule()
            p.update(plan, worker.execute(plan))
        for rid in list(p.requests):
            assert p.abort(rid) is not None
        p.blocks.check_invariants()
        assert p.blocks.num_free_blocks == 60
        plan = p.schedule()  # tells the worker to drop everything it held
        worker.execute(plan)
        assert worker.seqs == {}


def test_finish_reasons():
    p = make(100)
    p.add_request(Request("len", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)))
    first = (sum([5, 6, 7]) * 31 + 3) % 97 + 3
    p.add_request(Request("eos", [5, 6, 7], SamplingParams(max_tokens=9), eos_token_ids=[first]))
    p.add_request(
        Request("min", [5, 6, 7], SamplingParams(max_tokens=3, min_tokens=3), eos_token_ids=[first])
    )
    p.add_request(Request("stopid", [5, 6, 7], SamplingParams(max_tokens=9, stop_token_ids=[first])))
    w = CountingWorker()
    reasons = {}
    while p.has_unfinished():
        plan = p.schedule()
        for d in p.update(plan, w.execute(plan)):
            if d.finished:
                reasons[d.request_id] = (d.finish_reason, d.num_output_tokens)
    assert reasons["len"] == (FinishReason.LENGTH, 4)
    assert reasons["eos"] == (FinishReason.STOP, 1)
    assert reasons["min"] == (FinishReason.LENGTH, 3)
    assert reasons["stopid"] == (FinishReason.STOP, 1)


def test_priority_policy_runs_urgent_first_and_preempts_the_least_urgent():
    p = make(400, policy="priority", max_num_seqs=1)
    p.add_request(Request("late", [1, 2, 3], SamplingParams(max_tokens=2), priority=5))
    p.add_request(Request("urgent", [1, 2, 3], SamplingParams(max_tokens=2), priority=-1))
    plan = p.schedule()
    assert [s.seq_id for s in plan.new_seqs] == ["urgent"]


def test_rejects_what_can_never_run():
    p = make(4)
    with pytest.raises(RequestRejected):
        p.add_request(Request("big", list(range(20)), SamplingParams(max_tokens=100)))
    with pytest.raises(RequestRejected):
        p.add_request(Request("empty", [], SamplingParams()))
    with pytest.raises(RequestRejected):
        make(400).add_request(Request("ctx", list(range(600)), SamplingParams()))


def test_one_big_request_does_not_hold_back_another_callers_request():
    """1,024 sequences of one request, then a 2-token request: it runs as soon as a slot frees."""
    cfg = PlannerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)
    planner = Planner(cfg, BlockManager(1024, 4))
    worker = CountingWorker()
    for i in range(1024):
        planner.add_request(
            Request(f"big/{i}", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), group="big")
        )
    for _ in range(2):  # the big request fills the batch
        plan = planner.schedule()
        planner.update(plan, worker.execute(plan))
    planner.add_request(Request("small", [9, 9], SamplingParams(max_tokens=2, ignore_eos=True)))
    steps = 0
    while "small" in planner.requests:
        plan = planner.schedule()
        planner.update(plan, worker.execute(plan))
        steps += 1
    assert steps <= 6  # ~one generation of the big request's running sequences, not 128 of them
    # Alone again, the big request takes the whole batch (fairness leaves no slot idle).
    plan = planner.schedule()
    assert plan.num_seqs == cfg.max_num_seqs


def test_resync_after_a_lost_plan_forgets_the_keys_it_never_wrote():
    """A plan lost with its link: its newly keyed blocks must not serve later prefix hits."""
    cfg = PlannerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    planner = Planner(cfg, BlockManager(64, 4))
    worker = CountingWorker()
    prompt = list(range(10, 30))  # 5 full blocks of 4
    planner.add_request(Request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    lost = planner.schedule()  # computes the prompt, keys its 5 blocks ... and is never answered
    assert len(planner.blocks.longest_cached_prefix(prompt)) == 5
    planner.resync(last_executed_step_id=lost.step_id - 1)
    assert planner.blocks.longest_cached_prefix(prompt) == []
    worker.seqs.clear()  # the worker's new stream holds nothing
    out = run(planner, worker)
    assert len(out["a"]) == 3


def test_resync_after_an_executed_plan_keeps_the_prefix_cache():
    cfg = PlannerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    planner = Planner(cfg, BlockManager(64, 4))
    worker = CountingWorker()
    prompt = list(range(10, 30))
    planner.add_request(Request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    plan = planner.schedule()
    worker.execute(plan)  # executed, but its result was lost on the way back
    planner.resync(last_executed_step_id=plan.step_id)
    assert len(planner.blocks.longest_cached_prefix(prompt)) == 5
    worker.seqs.clear()
    fresh = Planner(cfg, BlockManager(64, 4))
    fresh.add_request(Request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    assert run(planner, worker) == run(fresh, CountingWorker())  # no token lost or duplicated
    planner.resync(last_executed_step_id=None)  # a new worker process: nothing is cached any more
    assert planner.blocks.longest_cached_prefix(prompt) == []


def run_pipelined(planner: Planner, worker: CountingWorker, depth: int = 2) -> dict[str, list[int]]:
    """Asynchronous scheduling: up to `depth` plans in flight, results applied a step late."""
    from collections import deque

    out: dict[str, list[int]] = {}
    inflight: deque = deque()
    while planner.has_work_for_worker() or inflight:
        while len(inflight) < depth and planner.has_work_for_worker():
            plan = planner.schedule()
            if plan.num_seqs == 0 and not plan.finished_ids and not plan.preempted_ids:
                break
            inflight.append((plan, worker.execute(plan)))  # the worker runs plans in order
        if not inflight:
            break
        plan, result = inflight.popleft()
        for d in planner.update(plan, result):
            assert not out.get(d.request_id) or not d.new_token_ids or d.request_id in out
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
        planner.blocks.check_invariants()
    assert not planner.has_unfinished()
    assert planner.blocks.num_free_blocks == planner.blocks.num_blocks
    return out


def eos_workload(seed: int = 0, n: int = 12) -> list[Request]:
    """Requests that stop on an EOS token mid-flight (the worker's tokens are in [3, 100))."""
    return [
        Request(r.request_id, r.prompt_token_ids, SamplingParams(max_tokens=40), eos_token_ids=[7, 11, 50])
        for r in workload(seed, n)
    ]


@pytest.mark.parametrize("kind", ["plain", "eos", "pressure"])
def test_pipelined_plans_give_the_same_tokens(kind):
    """Two plans in flight: no token lost, duplicated or leaked past an EOS; every block freed."""
    reqs = eos_workload if kind == "eos" else workload
    size = dict(num_blocks=24, max_num_batched_tokens=32, long_prefill_token_threshold=16)
    cfg = size if kind == "pressure" else dict(num_blocks=400)
    sync = make(cfg["num_blocks"], **{k: v for k, v in cfg.items() if k != "num_blocks"})
    for r in reqs():
        sync.add_request(r)
    ref = run(sync, CountingWorker())
    piped = make(cfg["num_blocks"], **{k: v for k, v in cfg.items() if k != "num_blocks"})
    for r in reqs():
        piped.add_request(r)
    assert run_pipelined(piped, CountingWorker()) == ref
    if kind == "eos":
        assert any(len(t) < 40 for t in ref.values())  # some did stop on EOS
    if kind == "pressure":
        assert piped.num_preemptions > 0


def test_abort_with_two_plans_in_flight_frees_everything():
    for stop_after in range(1, 20, 3):
        p = make(60)
        for r in workload(1):
            p.add_request(r)
        worker = CountingWorker()
        first = p.schedule()
        first_result = worker.execute(first)
        for _ in range(stop_after):
            second = p.schedule()
            second_result = worker.execute(second)
            p.update(first, first_result)
            first, first_result = second, second_result
        for rid in list(p.requests):
            p.abort(rid)
        p.update(first, first_result)  # a result arriving after the aborts changes nothing
        last = p.schedule()
        worker.execute(last)  # the drops reach the worker
        assert not worker.seqs and not p.has_unfinished()
        assert p.blocks.num_free_blocks == 60
