"""The router's choice: prefix overlap minus load, the policies without the index, session affinity,
and its own accounting of what it routed (fresher than the shards' reports)."""

from __future__ import annotations

from router_svc.core import Router, RouterConfigView, ShardLoad
from router_svc.index import Batch

BLOCK = 4
PROMPT = list(range(3, 3 + 64))  # 16 blocks


def router(policy: str = "index", shards: int = 3, **kw) -> Router:
    r = Router(RouterConfigView(policy=policy, **kw))  # type: ignore[arg-type]
    for i in range(shards):
        s = r.add_shard(f"s{i}", f"h:{i}")
        s.block_size, s.fingerprint = BLOCK, b"fp"
        r.set_connected(s, True)
        r.on_batch(s, Batch("e", 1, snapshot=True), ShardLoad(num_workers=1))
    return r


def hold(r: Router, shard: str, prompt: list[int], blocks: int) -> None:
    keys = r.prompt_keys(prompt, "", BLOCK, b"fp")[:blocks]
    s = r.shards[shard]
    r.on_batch(s, Batch("e", s.feed.expected, stored=keys))


def test_the_shard_holding_the_longest_prefix_wins():
    r = router()
    hold(r, "s1", PROMPT, 16)
    hold(r, "s2", PROMPT, 8)
    ranked = r.rank(PROMPT + [1, 2])
    assert [(s.shard_id, cached) for s, cached in ranked] == [("s1", 64), ("s2", 32), ("s0", 0)]


def test_load_outweighs_a_prefix_worth_less_than_the_queue_ahead():
    r = router()
    hold(r, "s1", PROMPT, 16)
    r.shards["s1"].load = ShardLoad(queued_tokens=1000, num_workers=1)
    assert r.rank(PROMPT)[0][0].shard_id != "s1"  # 1000 queued > the 64 tokens it saves
    r.shards["s1"].load = ShardLoad(queued_tokens=10, num_workers=1)
    assert r.rank(PROMPT)[0][0].shard_id == "s1"


def test_a_salted_prompt_does_not_match_unsalted_blocks():
    r = router()
    hold(r, "s1", PROMPT, 16)
    assert all(cached == 0 for _, cached in r.rank(PROMPT, salt="tenant-b"))


def test_load_policy_ignores_the_index_and_round_robin_cycles():
    r = router("load")
    hold(r, "s1", PROMPT, 16)
    r.shards["s0"].load = ShardLoad(queued_tokens=5, num_workers=1)
    r.shards["s1"].load = ShardLoad(queued_tokens=50, num_workers=1)
    assert r.rank(PROMPT)[0][0].shard_id == "s2"
    rr = router("round-robin")
    assert [rr.rank(PROMPT)[0][0].shard_id for _ in range(4)] == ["s0", "s1", "s2", "s0"]


def test_routed_requests_count_as_load_until_they_start():
    r = router()
    first, cached = r.rank(PROMPT)[0]
    ticket = r.routed(first, len(PROMPT), cached)
    assert first.pending_tokens == 64 and first.inflight == 1
    assert r.rank(PROMPT)[0][0] is not first  # a burst spreads before any report comes back
    r.started(ticket)
    assert first.pending_tokens == 0
    r.finished(ticket)
    r.finished(ticket)  # idempotent
    assert first.inflight == 0


def test_sessions_stick_to_their_shard_until_it_costs_too_much():
    r = router(session_slack_tokens=100)
    first = r.rank(PROMPT, session="alice")[0][0]
    r.shards[first.shard_id].load = ShardLoad(queued_tokens=50, num_workers=1)
    assert r.rank(PROMPT, session="alice")[0][0] is first  # 50 tokens worse: within the slack
    r.shards[first.shard_id].load = ShardLoad(queued_tokens=500, num_workers=1)
    moved = r.rank(PROMPT, session="alice")[0][0]
    assert moved is not first
    assert r.rank(PROMPT, session="alice")[0][0] is moved


def test_sessions_are_bounded():
    r = router(max_sessions=2)
    for name in "abc":
        r.rank(PROMPT, session=name)
    assert list(r.sessions) == ["b", "c"]


def test_shards_not_ready_get_nothing():
    r = router()
    r.set_connected(r.shards["s0"], False)
    r.shards["s1"].draining = True
    r.shards["s2"].load = ShardLoad(num_workers=0)
    assert r.rank(PROMPT) == []
