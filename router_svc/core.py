"""The router's decisions, transport-free: which shard runs a request.

Each shard is a scheduler with its pool of workers. A request goes to the shard where it would
start soonest, estimated in tokens of prefill work (llm-d's precise prefix-cache scorer and
vLLM-router's "overlap minus load", in one unit):

    cost(shard) = prefix_weight * (prompt tokens the shard does not hold)  -- its own prefill
                + max(reported, routed here and not started) queued tokens  -- work ahead of it
                + running_cost_tokens * requests running there               -- decode batch it joins

`policy`: "index" (the above), "load" (the same without the prefix term: what a router without the
global index can do), "round-robin" (across shards). Shards that are not ready (no snapshot yet,
link down, draining, no worker) get nothing; shards that refused a request (full) or failed before
it started are excluded for its retry.

A request picked for a caller that streams from the shard itself (ShardPicker.Route) is booked
(`book`): its prefill tokens and one running request count on that shard until a load report
sent after it reached the shard (this router never sees it start or end). Reports carry no
request ids, so "after" is by age: a report drops the bookings older than `booking_grace_s`
(the caller's trip from Route to the shard); younger ones may count twice for a moment, which
only errs towards spreading a burst.

Session affinity: a request with a session key goes where the session's last request went, unless
that shard is gone or costs `session_slack_tokens` more than the best one (then the session moves).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Literal

from router_svc.index import Batch, PrefixIndex, ShardFeed
from services.lora_config import lora_cache_root
from services.prefix_hash import extend_block_keys, root_key, short_key
from services.shard_load import ShardLoad

Policy = Literal["index", "load", "round-robin"]


@dataclass
class Shard:
    shard_id: str
    address: str
    feed: ShardFeed
    registered: bool = False  # joined by RegisterShard / DNS (forgotten when dead), not --shards
    load: ShardLoad = field(default_factory=ShardLoad)
    connected: bool = False  # its event stream is up
    draining: bool = False
    block_size: int = 0
    fingerprint: bytes = b""
    # This router's own view, fresher than the reports between two of them.
    pending_tokens: int = 0  # prefill tokens routed here whose request has not started
    inflight: int = 0  # requests routed here and still streaming
    routed: int = 0
    # What this router saw change since the shard's last report (that report still counts it):
    # prefill tokens of its requests that started, its requests that ended.
    started_since_report: int = 0
    ended_since_report: int = 0
    # Requests picked here for callers that stream from the shard themselves (`book`): this router
    # never sees them start or end, so they count until the shard's next report, which has them.
    booked_tokens: int = 0
    booked_requests: int = 0
    bookings: deque[tuple[float, int]] = field(default_factory=deque)  # (when, prefill tokens)
    down_since: float | None = None

    @property
    def ready(self) -> bool:
        return self.connected and self.feed.synced and not self.draining and self.load.num_workers > 0

    @property
    def bit(self) -> int:
        bit = self.feed.index.shard_bit(self.shard_id)
        assert bit is not None
        return bit


@dataclass
class Ticket:
    """One routed attempt of a request: released when it starts and when it ends."""

    shard: Shard
    prefill_tokens: int
    cached_tokens: int
    started: bool = False
    done: bool = False


@dataclass
class RouterConfigView:
    policy: Policy = "index"
    running_cost_tokens: int = 32
    session_slack_tokens: int = 8192
    max_sessions: int = 100_000
    session_ttl_s: float = 600.0
    max_reorder: int = 0
    prefix_weight: float = 2.0
    booking_grace_s: float = 0.005  # a Route answer's trip to its shard, at most (loopback, a LAN)


class Router:
    def __init__(self, config: RouterConfigView | None = None) -> None:
        self.config = config or RouterConfigView()
        self.index = PrefixIndex()
        self.shards: dict[str, Shard] = {}
        self.sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> shard id, last use
        self._rr = itertools.count()
        self.num_routed = 0
        self.num_prefix_tokens = 0  # prompt tokens routed to a shard that held them cached
        self.num_prompt_tokens = 0

    # ----- shards -----
    def add_shard(self, shard_id: str, address: str, registered: bool = False) -> Shard:
        shard = self.shards.get(shard_id)
        if shard is None:
            shard = Shard(shard_id, address, ShardFeed(self.index, shard_id, self.config.max_reorder))
            self.index.bit(shard_id)
            self.shards[shard_id] = shard
        shard.address, shard.registered = address, shard.registered or registered
        shard.draining = False
        return shard

    def remove_shard(self, shard_id: str) -> Shard | None:
        shard = self.shards.pop(shard_id, None)
        if shard is not None:
            self.index.drop_shard(shard_id)
        return shard

    def on_batch(self, shard: Shard, batch: Batch, load: ShardLoad | None = None) -> bool:
        """A batch of the shard's events (and its load); False: out of sync, subscribe again."""
        if load is not None:
            shard.load = load
            shard.started_since_report = shard.ended_since_report = 0
            self._expire_bookings(shard)
        return shard.feed.receive(batch)

    def set_connected(self, shard: Shard, connected: bool) -> None:
        shard.connected = connected
        shard.down_since = None if connected else (shard.down_since or time.monotonic())

    @property
    def ready_shards(self) -> list[Shard]:
        return [s for s in self.shards.values() if s.ready]

    # ----- routing -----
    def prompt_keys(
        self,
        prompt: list[int],
        salt: str,
        block_size: int,
        fingerprint: bytes,
        lora: tuple[str, str] = ("", ""),
    ) -> list[int]:
        """`lora`: the request's adapter (name, folder), which roots a chain of its own."""
        if not block_size:
            return []
        root = lora_cache_root(root_key(salt), *lora)
        full = extend_block_keys([], prompt, block_size, fingerprint, root)
        return [short_key(k) for k in full]

    def rank(
        self,
        prompt: list[int],
        salt: str = "",
        session: str = "",
        exclude: set[str] | frozenset = frozenset(),
        lora: tuple[str, str] = ("", ""),
    ) -> list[tuple[Shard, int]]:
        """Ready shards, best first, with the prompt tokens each holds cached."""
        shards = [s for s in self.ready_shards if s.shard_id not in exclude]
        if not shards:
            return []
        policy = self.config.policy
        if policy == "round-robin":
            start = next(self._rr) % len(shards)
            return [(s, 0) for s in shards[start:] + shards[:start]]
        cached: dict[str, int] = {}
        if policy == "index":
            cached = self._cached_tokens(prompt, salt, shards, lora)
        costs = {s.shard_id: self._cost(s, len(prompt), cached.get(s.shard_id, 0)) for s in shards}
        ranked = sorted(shards, key=lambda s: (costs[s.shard_id], s.inflight, s.routed))
        if session:
            ranked = self._affine(session, ranked, costs)
        return [(s, cached.get(s.shard_id, 0)) for s in ranked]

    def by_load(self) -> list[Shard]:
        """Ready shards, least loaded first (calls other than Generate: no routing state moves)."""
        return sorted(self.ready_shards, key=lambda s: (self._cost(s, 0, 0), s.inflight))

    def _cached_tokens(
        self, prompt: list[int], salt: str, shards: list[Shard], lora: tuple[str, str] = ("", "")
    ) -> dict[str, int]:
        out: dict[str, int] = {}
        by_layout: dict[tuple[int, bytes], list[Shard]] = {}
        for s in shards:
            by_layout.setdefault((s.block_size, s.fingerprint), []).append(s)
        for (block_size, fingerprint), group in by_layout.items():
            keys = self.prompt_keys(prompt, salt, block_size, fingerprint, lora)
            if not keys:
                continue
            bits = {s.bit: s for s in group}
            found = self.index.overlap(keys, sum(bits))
            for bit, blocks in found.items():
                out[bits[bit].shard_id] = blocks * block_size
        return out

    def _cost(self, shard: Shard, prompt_tokens: int, cached: int) -> int:
        load = shard.load
        # The report, less what this router knows has changed since, or this router's own count
        # (fresher, but blind to other routers' requests), whichever is more.
        queued = max(load.queued_tokens - shard.started_since_report, shard.pending_tokens)
        queued += shard.booked_tokens
        running = max(load.running - shard.ended_since_report, shard.inflight) + shard.booked_requests
        own = self.config.prefix_weight * (prompt_tokens - cached)
        return int(own) + queued + self.config.running_cost_tokens * running

    def _affine(self, session: str, ranked: list[Shard], costs: dict[str, int]) -> list[Shard]:
        now = time.monotonic()
        sessions = self.sessions
        held = sessions.get(session)
        best = ranked[0]
        if held is not None and now - held[1] <= self.config.session_ttl_s:
            mine = next((s for s in ranked if s.shard_id == held[0]), None)
            if (
                mine is not None
                and costs[mine.shard_id] - costs[best.shard_id] <= self.config.session_slack_tokens
            ):
                best = mine
        sessions[session] = (best.shard_id, now)
        sessions.move_to_end(session)
        while len(sessions) > self.config.max_sessions:
            sessions.popitem(last=False)
        return [best, *[s for s in ranked if s is not best]]

    # ----- accounting -----
    def routed(self, shard: Shard, prompt_tokens: int, cached: int) -> Ticket:
        prefill = max(prompt_tokens - cached, 0)
        shard.pending_tokens += prefill
        shard.inflight += 1
        shard.routed += 1
        self.num_routed += 1
        self.num_prompt_tokens += prompt_tokens
        self.num_prefix_tokens += cached
        return Ticket(shard, prefill, cached)

    def book(self, shard: Shard, prompt_tokens: int, cached: int) -> None:
        """A request picked for a caller that streams from the shard itself (ShardPicker.Route):
        an optimistic bump of the shard's load, replaced by its next report."""
        prefill = max(prompt_tokens - cached, 0)
        shard.bookings.append((time.monotonic(), prefill))
        shard.booked_tokens += prefill
        shard.booked_requests += 1
        shard.routed += 1
        self.num_routed += 1
        self.num_prompt_tokens += prompt_tokens
        self.num_prefix_tokens += cached

    def _expire_bookings(self, shard: Shard) -> None:
        """A load report counts the booked requests that reached the shard before it was sent."""
        bookings, horizon = shard.bookings, time.monotonic() - self.config.booking_grace_s
        while bookings and bookings[0][0] <= horizon:
            _, prefill = bookings.popleft()
            shard.booked_tokens -= prefill
            shard.booked_requests -= 1

    def started(self, ticket: Ticket) -> None:
        if not ticket.started and not ticket.done:
            ticket.started = True
            ticket.shard.pending_tokens -= ticket.prefill_tokens
            ticket.shard.started_since_report += ticket.prefill_tokens

    def finished(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        if not ticket.started:
            ticket.shard.pending_tokens -= ticket.prefill_tokens
        ticket.done = True
        ticket.shard.inflight -= 1
        ticket.shard.ended_since_report += 1
