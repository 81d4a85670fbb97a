"""Planning the KV tiers: saves a plan late, host loads past a GPU hit, store loads by chunk, lost plans."""

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.kv_tiers import KVTierPlanner
from scheduler_svc.planner import Planner, PlannerConfig
from scheduler_svc.prefix_hash import extend_block_keys
from scheduler_svc.request import Request
from scheduler_svc.router import route
from services.sampling_params import SamplingParams
from services.step import StepPlan, StepResult

BS = 4


def chain(tokens: list[int]) -> list[bytes]:
    return extend_block_keys([], tokens, BS, b"fp")


def make_planner(num_blocks: int = 16, host_slots: int = 32, chunk_blocks: int = 2) -> Planner:
    blocks = BlockManager(num_blocks, BS, b"fp")
    return Planner(
        PlannerConfig(max_num_seqs=4, max_model_len=256),
        blocks,
        KVTierPlanner(blocks, host_slots, chunk_blocks),
    )


def request(rid: str, tokens: list[int], max_tokens: int = 1) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run(planner: Planner) -> list[StepPlan]:
    """Step until nothing is left, sampling token 7 for whoever samples; the plans made."""
    plans = []
    while planner.has_work_for_worker():
        plan = planner.schedule()
        plans.append(plan)
        sampled = [
            s.seq_id for s in plan.new_seqs if s.num_computed_tokens + s.num_new_tokens == len(s.token_ids)
        ]
        sampled += [s.seq_id for s in plan.scheduled]
        planner.update(plan, StepResult(plan.step_id, sampled, [7] * len(sampled), [None] * len(sampled)))
    return plans


def test_blocks_are_saved_by_the_next_plan_and_loaded_back_past_the_gpu_hit() -> None:
    planner = make_planner(num_blocks=8)
    prompt = list(range(1, 18))  # 4 full blocks + 1 token
    planner.add_request(request("a", prompt))
    plans = run(planner)
    assert not plans[0].kv.save_block_ids  # computed by the first plan, saved by the second
    saved = plans[1].kv
    assert len(saved.save_block_ids) == 4 and len(set(saved.save_host_slots)) == 4
    assert [p.key for p in saved.store_puts] == [chain(prompt)[i] for i in (1, 3)]

    planner.add_request(request("flood", list(range(100, 129))))  # takes every block: evicts "a"
    run(planner)
    assert planner.blocks.longest_cached_prefix(prompt) == []
    planner.add_request(request("a2", prompt + [5, 6, 7]))
    plan = planner.schedule()
    assert plan.kv.load_host_slots == saved.save_host_slots
    new = plan.new_seqs[0]
    assert new.num_computed_tokens == 16 and new.num_new_tokens == 4
    assert plan.kv.load_block_ids == new.block_ids[:4]
    assert planner.tiers.stats.host_hit_tokens == 16


def test_store_hits_become_chunk_loads_with_skips_and_are_not_put_back() -> None:
    planner = make_planner(host_slots=0, chunk_blocks=2)
    prompt = list(range(1, 22))  # 5 full blocks + 1
    warm = request("warm", prompt[:4] + [99])  # block 0 cached on the GPU
    planner.add_request(warm)
    run(planner)
    req = request("b", prompt)
    req.store_hit_blocks = 4  # the store holds chunks 0 and 1
    planner.add_request(req)
    plan = planner.schedule()
    load = plan.kv.store_loads[0]
    keys = chain(prompt)
    assert load.keys == [keys[1], keys[3]]
    new = plan.new_seqs[0]
    assert load.block_ids == [-1, *new.block_ids[1:4]]  # block 0 was a GPU hit
    assert new.num_computed_tokens == 16 and new.num_new_tokens == 5
    follow = planner.schedule()
    assert not follow.kv.store_puts  # loaded chunks are already in the store


def test_a_loaded_chunk_is_not_put_back_even_when_registered_by_a_later_plan() -> None:
    """With plans in flight, a loaded chunk's blocks may be registered full by a plan after the
    one that loads them (seen on an H100: up to 29 of 32 loaded chunks put back)."""
    planner = make_planner(host_slots=0, chunk_blocks=2)
    prompt = list(range(1, 22))
    req = request("b", prompt)
    req.store_hit_blocks = 4
    planner.add_request(req)
    plan = planner.schedule()
    loaded = plan.kv.store_loads[0]
    # The same chunks turn up as newly completed later, under other blocks' ids.
    planner.blocks._newly_chunked.append((loaded.keys[0], [11, 12]))
    planner.blocks._newly_chunked.append((b"computed-chunk", [13, 14]))
    later = planner.tiers.finish_plan(plan.step_id + 1, [])
    assert later.store_puts == []  # what the first plan made full: nothing new to put
    puts = planner.tiers.finish_plan(plan.step_id + 2, []).store_puts
    assert [p.key for p in puts] == [b"computed-chunk"]


def test_a_lost_plan_forgets_the_host_slots_it_assigned() -> None:
    planner = make_planner()
    planner.add_request(request("a", list(range(1, 10)), max_tokens=3))
    first = planner.schedule()
    second = planner.schedule()  # carries the saves of the first plan's blocks
    assert second.kv.save_block_ids
    assert len(planner.tiers.host) == 2
    planner.resync(first.step_id)  # the worker ran the first plan, never the second
    assert len(planner.tiers.host) == 0


def test_routing_counts_a_workers_host_tier() -> None:
    a, b = make_planner(num_blocks=8), make_planner(num_blocks=8)
    prompt = list(range(1, 18))
    a.add_request(request("x", prompt))
    run(a)
    a.add_request(request("flood", list(range(100, 129))))
    run(a)
    assert a.blocks.longest_cached_prefix(prompt) == []
    choice = route({"a": a, "b": b}, prompt + [1], overload_margin=8)
    assert choice.worker_id == "a" and choice.cached_tokens == 16
