"""Tenant isolation of the prefix cache (vLLM's `cache_salt`): salted key chains, and what the
block manager, planner, tiers and router find under them."""

import pytest

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.kv_tiers import KVTierPlanner
from scheduler_svc.planner import Planner, PlannerConfig
from scheduler_svc.prefix_hash import MAX_SALT_BYTES, ROOT_KEY, check_salt, extend_block_keys, root_key
from scheduler_svc.request import Request
from scheduler_svc.router import route
from services.sampling_params import SamplingParams
from services.step import StepPlan, StepResult

BS = 4
PROMPT = list(range(1, 18))  # 4 full blocks + 1 token


def chain(tokens: list[int], salt: str = "") -> list[bytes]:
    return extend_block_keys([], tokens, BS, b"fp", root_key(salt))


def make_planner(num_blocks: int = 16, host_slots: int = 0, chunk_blocks: int = 2) -> Planner:
    blocks = BlockManager(num_blocks, BS, b"fp")
    config = PlannerConfig(max_num_seqs=4, max_model_len=256)
    return Planner(config, blocks, KVTierPlanner(blocks, host_slots, chunk_blocks))


def request(rid: str, tokens: list[int], salt: str = "") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True), cache_salt=salt)


def run(planner: Planner) -> list[StepPlan]:
    """Step until nothing is left, sampling token 7 for whoever samples; the plans made."""
    plans = []
    while planner.has_work_for_worker():
        plan = planner.schedule()
        plans.append(plan)
        done = [
            s.seq_id for s in plan.new_seqs if s.num_computed_tokens + s.num_new_tokens == len(s.token_ids)
        ]
        done += [s.seq_id for s in plan.scheduled]
        planner.update(plan, StepResult(plan.step_id, done, [7] * len(done), [None] * len(done)))
    return plans


def cached_tokens(planner: Planner, rid: str, tokens: list[int], salt: str) -> int:
    req = request(rid, tokens, salt)
    planner.add_request(req)
    run(planner)
    return req.num_cached_tokens


# ----- keys -----
def test_the_empty_salt_keeps_todays_keys() -> None:
    assert root_key("") == ROOT_KEY
    assert chain(PROMPT, "") == extend_block_keys([], PROMPT, BS, b"fp")
    assert Request("r", PROMPT, SamplingParams()).cache_root == ROOT_KEY


def test_a_salt_changes_every_key_of_the_chain_from_the_first_on() -> None:
    plain, a, b = chain(PROMPT), chain(PROMPT, "tenant-a"), chain(PROMPT, "tenant-b")
    assert len(plain) == len(a) == len(b) == 4
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)
    assert chain(PROMPT, "tenant-a") == a  # the same salt, the same chain
    assert root_key("tenant-a") not in (ROOT_KEY, *plain)
    assert len(root_key("x" * 1000)) == 32


def test_salts_are_checked_in_utf8_bytes() -> None:
    check_salt("")
    check_salt("é" * (MAX_SALT_BYTES // 2))
    with pytest.raises(ValueError, match="256 bytes"):
        check_salt("é" * (MAX_SALT_BYTES // 2 + 1))


# ----- block manager -----
def test_block_manager_hits_only_under_the_same_salt() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, fingerprint=b"fp")
    a = root_key("a")
    bm.allocate("x", PROMPT, 0, len(PROMPT), root=a)
    assert bm.tables["x"].keys == chain(PROMPT, "a")
    assert len(bm.longest_cached_prefix(PROMPT, root=a)) == 4
    assert bm.longest_cached_prefix(PROMPT, root=root_key("b")) == []
    assert bm.longest_cached_prefix(PROMPT) == []  # unsalted
    # A second sequence of salt b computes its own copy of the same tokens.
    bm.allocate("y", PROMPT, 0, len(PROMPT), root=root_key("b"))
    assert not set(bm.block_ids("x")) & set(bm.block_ids("y"))
    bm.check_invariants()


# ----- planner, tiers, router -----
def test_planner_gives_no_hit_across_salts_and_a_hit_within_one() -> None:
    planner = make_planner()
    assert cached_tokens(planner, "a1", PROMPT, "a") == 0
    assert cached_tokens(planner, "b1", PROMPT, "b") == 0
    assert cached_tokens(planner, "u1", PROMPT, "") == 0
    assert cached_tokens(planner, "a2", PROMPT, "a") == 16
    assert cached_tokens(planner, "b2", PROMPT, "b") == 16
    assert planner.cached_prefix_tokens(PROMPT, root_key("a")) == 16
    assert planner.cached_prefix_tokens(PROMPT, root_key("c")) == 0


def test_store_puts_and_loads_use_the_salted_chain() -> None:
    planner = make_planner(chunk_blocks=2)
    planner.add_request(request("a", PROMPT, "a"))
    puts = [p.key for plan in run(planner) for p in plan.kv.store_puts]
    keys = chain(PROMPT, "a")
    assert puts == [keys[1], keys[3]]  # the keys the worker puts to the KV store are salted
    req = request("b", PROMPT + [1, 2, 3, 4], "a")
    req.store_hit_blocks = 4
    fresh = make_planner(chunk_blocks=2)
    fresh.add_request(req)
    assert fresh.schedule().kv.store_loads[0].keys == [keys[1], keys[3]]


def test_host_tier_hits_only_under_the_same_salt() -> None:
    planner = make_planner(num_blocks=8, host_slots=32)
    planner.add_request(request("a", PROMPT, "a"))
    run(planner)
    planner.add_request(request("flood", list(range(100, 129))))  # evicts "a" from the GPU cache
    run(planner)
    assert planner.cached_prefix_tokens(PROMPT, root_key("a")) == 16  # from the host tier
    assert planner.cached_prefix_tokens(PROMPT, root_key("b")) == 0
    assert planner.cached_prefix_tokens(PROMPT) == 0


def test_routing_counts_only_the_same_salts_blocks() -> None:
    a, b = make_planner(), make_planner()
    a.add_request(request("x", PROMPT, "a"))
    run(a)
    a.add_request(request("y", [1], ""))  # a is busier: only a hit makes it the choice
    choice = route({"b": b, "a": a}, PROMPT + [1], overload_margin=8, root=root_key("a"))
    assert choice.worker_id == "a" and choice.cached_tokens == 16
    other = route({"b": b, "a": a}, PROMPT + [1], overload_margin=8, root=root_key("b"))
    assert other.worker_id == "b" and other.cached_tokens == 0  # no hint of tenant a's prompt
