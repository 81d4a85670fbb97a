"""The scheduler's core over many workers: routing, one planning loop per worker, failover.

Transport-free: a worker is reached through a `WorkerLink` (the gRPC Step
stream in the service, a `LocalWorkerLink` to a model runner on a thread in
the offline engine and the tests). Callers get an asyncio queue of
`RequestDelta`s per request. Up to two plans are in flight per worker
(asynchronous scheduling): step N+1 is planned and sent while step N runs.

A broken link is not a dead worker. The worker's loop re-dials it with
backoff; if the same process answers (same `instance_id`), its prefix cache
survived and its requests continue there (recomputed mostly from cached
blocks); if a new process answers, its cache is forgotten. Meanwhile, after
`failover_after_s`, the requests move to the other live workers; a worker that
stays unreachable for `worker_dead_after_s` is removed. A moved request is
re-routed with prompt + the tokens generated so far, so it is recomputed
there and continues; callers see no error and no duplicated or lost tokens,
because deltas are only ever produced from the planner's own appended tokens.

Overload is answered before a request starts, never in the middle of it
(admission control, `Mesh.submit`): requests beyond what the workers' batches
hold wait, up to `max_waiting_requests` of them; past that a new request is
refused with `Overloaded` (RESOURCE_EXHAUSTED on the wire, HTTP 429 at the
gateway), which carries a retry-after: the time the waiting requests take to
drain at the recent finish rate. A request of better (lower) priority still
gets in: the worst waiting request that has not started is refused instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.disaggregation import (
    Disaggregation,
    Handover,
    StepFit,
    WorkerLoad,
    direct_compatible,
    load_of,
)
from scheduler_svc.kv_events import KVEventLog
from scheduler_svc.kv_tiers import KVTierPlanner
from scheduler_svc.load_predictor import LoadPredictor
from scheduler_svc.lora import LoRAMirror, lora_key
from scheduler_svc.planner import Planner, PlannerConfig, RequestRejected
from scheduler_svc.prefix_hash import extend_block_keys
from scheduler_svc.request import Request, RequestDelta
from scheduler_svc.router import route
from scheduler_svc.spec_decode import SpecDecodePolicy
from services.config import check_bounds, option
from services.sampling_params import SamplingParams
from services.step import StepPlan, StepResult, WorkerInfo, store_fingerprint

log = logging.getLogger(__name__)

# How often an idle worker loop checks that its step stream still stands.
IDLE_LINK_CHECK_S = 0.5
# Breaks in a row with no step completed in between: past this, the worker's own requests are
# failed (a plan that breaks the worker every time must not be replayed forever).
MAX_BREAKS_WITHOUT_PROGRESS = 3


class LinkBroken(Exception):
    """The worker is gone (stream broken, process dead, deadline passed)."""


class NoWorkerAvailable(Exception):
    """No live worker can take the request."""


class Overloaded(Exception):
    """The mesh is full: the request is refused before it started (RESOURCE_EXHAUSTED, HTTP 429).

    `retry_after_s`: when trying again is worth it (whole seconds, as HTTP's Retry-After)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# Retry-after bounds (s), and the window over which the finish rate that estimates it is measured.
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S, RETRY_AFTER_UNKNOWN_S = 1, 60, 5
DRAIN_WINDOW_S = 30.0


@dataclass
class Connected:
    """What a (re)connected link learnt: who the worker is, and the last plan it executed."""

    info: WorkerInfo
    last_step_id: int = 0


class WorkerLink(Protocol):
    async def connect(self, timeout_s: float = 10.0) -> Connected:
        """(Re)open the step stream; raises LinkBroken when the worker cannot be reached."""
        ...

    async def send(self, plan: StepPlan) -> None:
        """Queue a plan; the worker runs plans strictly in order (several may be in flight)."""
        ...

    async def recv(self) -> StepResult:
        """The result of the oldest plan in flight."""
        ...

    @property
    def alive(self) -> bool:
        """False once the step stream is known to be broken (checked while idle)."""
        ...

    def abandon(self) -> None:
        """Drop the current stream (known half-dead); the next step or idle check reconnects."""
        ...

    async def close(self) -> None: ...


class KVStoreLookup(Protocol):
    async def lookup(self, fingerprint: bytes, keys: list[bytes]) -> int:
        """How many leading chunk keys of a chain the store holds (raises when unreachable)."""
        ...


# Loop turns a peek (Mesh._peek) waits before its lookup: the consumers of the token just emitted
# (a gRPC stream's write; the offline caller's future, two turns) run first. Sent at once, the
# lookup's thread shared the GIL with an in-process caller waking up for its first token, and the
# puts it releases with it.
DELIVERY_TURNS = 3


async def _let_deliveries_run() -> None:
    for _ in range(DELIVERY_TURNS):
        await asyncio.sleep(0)


@dataclass
class MeshConfig:
    """The scheduler core's knobs, declared once: the scheduler service's config inherits them
    (and `planner`'s, flattened into flags: services/config.py), the offline engine sets them."""

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    enable_prefix_caching: bool = option(True, help="reuse KV blocks of shared prefixes")
    overload_margin: int = option(
        8,
        help="queued requests a prefix hit may cost before load wins (a worker this many more "
        "requests behind the least-loaded one loses its prefix advantage)",
    )
    worker_dead_after_s: float = option(
        30.0, gt=0, help="a worker whose link broke is re-dialled this long before it counts as dead"
    )
    failover_after_s: float = option(
        1.0, ge=0, help="an unreachable worker's requests move to the other workers after this long"
    )
    # Planning and the wire overlap the GPU instead of sitting between two steps.
    async_scheduling: bool = option(
        True, help="plan step N+1 while a worker runs step N (--no-async-scheduling: one plan at a time)"
    )
    kv_lookup_timeout_s: float = option(
        0.2, help="a KV store lookup slower than this counts as a miss (the prefix is computed)"
    )
    kv_load_predictor: bool = option(
        True,
        help="load a store hit only as far as loading is predicted faster than computing it, from "
        "the worker's measured load bandwidth and prefill rate (scheduler_svc/load_predictor.py); "
        "--no-kv-load-predictor: load every hit",
    )
    kv_load_prior_gbps: float = option(
        1.0,
        gt=0,
        help="the KV store load bandwidth (GB/s) the load predictor assumes until a worker's loads "
        "are measured (a hit it says not to load gets one chunk, to measure the path)",
    )
    # Larger values cut the per-token messages (one gRPC write, one SSE event each) that cost the
    # host more than the GPU at high concurrency, at the price of burstier streams.
    stream_interval: int = option(
        1,
        ge=1,
        help="after a request's first token, stream its tokens once this many are pending (vLLM's "
        "--stream-interval): fewer messages per token at high concurrency, burstier streams",
    )
    # Admission control: a bounded queue answers overload up front (SGLang's --max-queued-requests,
    # TGI's 429s) instead of letting waits grow without end. The offline engine passes 0: it queues
    # whatever it is given.
    max_waiting_requests: int = option(
        1024,
        ge=0,
        help="requests that may wait beyond the workers' batch slots (their max_num_seqs) before new "
        "ones are refused (gRPC RESOURCE_EXHAUSTED, HTTP 429, with a retry-after); a request of "
        "better (lower) priority still gets in, refusing the worst waiting one that has not started; "
        "0 = no bound",
    )

    # Disaggregated prefill/decode (scheduler_svc/disaggregation.py): with workers of --role prefill,
    # a prompt this long goes there and its KV to a decode worker; shorter ones stay whole.
    disaggregation_threshold: int = option(
        512,
        ge=0,
        help="with prefill workers (--role prefill) in the pool: a request whose decode worker would "
        "compute this many prompt tokens or more (not in its cache) is prefilled on a prefill "
        "worker and handed over through the KV store; shorter ones run whole on a decode worker",
    )
    handover_timeout_s: float = option(
        1.0,
        ge=0,
        help="a handover waits this long at most for the prompt's chunks to reach the KV store; then "
        "the decode worker computes what is missing",
    )
    direct_handover: bool = option(
        True,
        help="a decode worker on the prefill worker's host copies the prompt's KV blocks straight out "
        "of its cache (GPU to GPU through CUDA IPC; shared memory on the CPU) instead of through the "
        "KV store (--no-direct-handover: always the store)",
    )
    # The queue half of conditional disaggregation (disaggregation.py's QueueRule): a long prompt
    # stays on its decode worker, in bounded chunks, while the prefill worker's queue is long.
    disaggregation_max_queue_s: float = option(
        0.05,
        ge=0,
        help="a prompt long enough for a prefill worker still runs on its decode worker (in chunks "
        "of --disaggregation-local-chunk-tokens) when the prefill worker's predicted queue wait "
        "exceeds this many seconds and the decode worker is predicted to give its first token sooner",
    )
    # 1536: on 2x H100 (8B, 3 long prompts a second among chats) 512 and 1024 put chunks in too
    # many steps for the ITL p99 (1.6x and 1.99x lower than aggregated); 1536, 2.35x lower with
    # TTFT p90 0.98x (docs/benchmarks.md).
    disaggregation_local_chunk_tokens: int = option(
        1536,
        ge=0,
        help="on --role decode workers, the most prompt tokens one request computes in a step (vLLM's "
        "long_prefill_token_threshold), so a long prompt kept there leaves its decode batch's "
        "inter-token latency near a decode step's; 0: the step budget (no long prompt is kept there)",
    )

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass
class WorkerSlot:
    worker_id: str
    info: WorkerInfo
    link: WorkerLink
    planner: Planner
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    num_steps: int = 0
    step_seconds: float = 0.0  # sum of send -> result per plan (wire, queueing, execution)
    connected: bool = True  # False while the link is being re-dialled
    num_reconnects: int = 0
    breaks_without_progress: int = 0
    redial_now: asyncio.Event = field(default_factory=asyncio.Event)  # cut a re-dial backoff short
    num_inflight: int = 0  # plans sent whose results are not back
    inflight_tokens: int = 0  # their tokens (the queue rule's view of work under way)
    inflight_since: float = 0.0  # when the oldest of them started running (perf_counter)
    step_fit: StepFit = field(default_factory=StepFit)  # its step time by prompt tokens (queue rule)

    @property
    def settled(self) -> bool:
        """Nothing left to send or to hear back (every KV transfer planned so far has run)."""
        idle = self.num_inflight == 0 and not self.planner.has_work_for_worker()
        return idle and not self.planner.tiers.peeking  # a peek's answer may release puts


@dataclass
class _Stream:
    queue: asyncio.Queue
    worker_id: str
    held: RequestDelta | None = None  # tokens waiting for the stream interval (a copy of its own)
    started: bool = False  # a token went out: the first one is never held (time to first token)

    def flush(self) -> None:
        """Hand over what is held (before the stream moves, fails or is aborted)."""
        if self.held is not None:
            self.queue.put_nowait(self.held)
            self.held = None


class Mesh:
    def __init__(self, config: MeshConfig, kv_store: KVStoreLookup | None = None) -> None:
        self.config = config
        # Where new requests look up prefix chunks that another worker computed (None: nowhere).
        self.kv_store = kv_store
        self.num_kv_lookup_errors = 0
        self._lookups: set[asyncio.Task] = set()
        # Requests that skipped their lookup, peeked at once their first token is out (_peek).
        self._peeks_due: dict[str, tuple[WorkerSlot, Request]] = {}
        self.workers: dict[str, WorkerSlot] = {}
        self.streams: dict[str, _Stream] = {}
        self.ready = asyncio.Event()
        self.num_failovers = 0
        self.num_refused = 0  # requests refused because the mesh was full (Overloaded)
        # When the latest requests finished (the drain rate that retry_after_s estimates from).
        self._finished_at: deque[float] = deque(maxlen=4096)
        # Called with the number of live workers whenever one joins or leaves (health, metrics).
        self.on_workers_changed: list = []
        # The pool's KV events for the routers in front of this scheduler (kv_events.py); None: off.
        self.kv_events: KVEventLog | None = None
        # Prefill-role workers and the KV handovers to decode workers.
        self.pd = Disaggregation(
            config.disaggregation_threshold, config.handover_timeout_s, config.disaggregation_max_queue_s
        )
        self.pd.on_freed = self._wake  # held blocks freed: a prompt may have waited for them

    # ----- workers -----
    def add_worker(self, worker_id: str, info: WorkerInfo, link: WorkerLink) -> WorkerSlot:
        """Plan for a connected worker (its link's connect() has succeeded)."""
        if worker_id in self.workers:
            raise ValueError(f"worker {worker_id!r} is already registered")
        cfg = self.config.planner
        planner_cfg = replace(
            cfg.for_worker(info.max_num_seqs, info.max_num_batched_tokens),
            max_model_len=min(cfg.max_model_len or info.max_model_len, info.max_model_len),
        )
        if info.role == "decode" and not planner_cfg.long_prefill_token_threshold:
            # Bounded chunks: a long prompt the queue rule keeps here shares steps with the decodes.
            chunk = self.config.disaggregation_local_chunk_tokens
            planner_cfg = replace(planner_cfg, long_prefill_token_threshold=chunk)
        blocks = BlockManager(
            info.num_kv_blocks, info.block_size, info.fingerprint, self.config.enable_prefix_caching
        )
        if self.kv_events is not None:  # the routers in front hear of every key it holds
            blocks.listener = self.kv_events.worker(worker_id, info.block_size, info.fingerprint)
        prior = self.config.kv_load_prior_gbps * 1e9
        on = self.config.kv_load_predictor
        predictor = LoadPredictor(info.block_size, on, info.kv_block_bytes, prior)
        tiers = KVTierPlanner(blocks, info.num_host_blocks, info.kv_chunk_blocks, predictor)
        spec = SpecDecodePolicy(
            info.num_speculative_tokens, info.spec_disable_by_batch_size, info.spec_drafts_ahead
        )
        slot = WorkerSlot(worker_id, info, link, Planner(planner_cfg, blocks, tiers, spec))
        slot.planner.loras = LoRAMirror(info.max_loras)
        self.workers[worker_id] = slot
        slot.task = asyncio.get_running_loop().create_task(self._run(slot), name=f"worker-loop-{worker_id}")
        self.ready.set()
        self._notify()
        log.info("worker joined", extra={"worker_id": worker_id, "blocks": info.num_kv_blocks})
        return slot

    async def replace_worker(self, worker_id: str, info: WorkerInfo, link: WorkerLink) -> WorkerSlot:
        """A new process took a worker's id (it restarted): plan for it, move the old one's requests.

        The new slot exists before the old requests are re-routed, so a lone
        worker's requests wait for its restarted self instead of failing.
        """
        old = await self._detach(worker_id)
        slot = self.add_worker(worker_id, info, link)
        if old is not None:
            log.warning("worker restarted", extra={"worker_id": worker_id})
            self._requeue(old)
        return slot

    async def remove_worker(self, worker_id: str, reason: str = "removed") -> None:
        slot = await self._detach(worker_id)
        if slot is None:
            return
        log.warning("worker left", extra={"worker_id": worker_id, "reason": reason})
        self._requeue(slot)

    async def _detach(self, worker_id: str) -> WorkerSlot | None:
        slot = self.workers.pop(worker_id, None)
        if slot is None:
            return None
        self.pd.peer_gone(worker_id)  # its held blocks: copies not planned yet are recomputes
        self.pd.release_decoder(worker_id, planned_too=True)  # its plans run no more
        if self.kv_events is not None:
            self.kv_events.worker_gone(worker_id)
        if not self.workers:
            self.ready.clear()
        self._notify()
        if slot.task is not None and slot.task is not asyncio.current_task():
            slot.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await slot.task
        with contextlib.suppress(Exception):
            await slot.link.close()
        return slot

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def num_connected(self) -> int:
        return sum(s.connected for s in self.workers.values())

    @property
    def model_info(self) -> WorkerInfo | None:
        return next((s.info for s in self.workers.values()), None)

    # ----- requests -----
    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        queue: asyncio.Queue | None = None,
        group: str = "",
        cache_salt: str = "",
        lora_name: str = "",
        lora_path: str = "",
    ) -> asyncio.Queue:
        """Route and enqueue a request; its deltas go to `queue` (shared by a request's n choices).

        `cache_salt`: the tenant's prefix-cache salt ("" = shared with every unsalted request).
        `lora_name`, `lora_path`: the LoRA adapter to run it with ("" = the base model).
        """
        if lora_name and not any(s.info.max_loras for s in self.workers.values()):
            raise RequestRejected(f"LoRA adapter {lora_name!r}: no worker serves LoRA (--enable-lora)")
        if request_id in self.streams:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        info = self.model_info
        if info is None:
            raise NoWorkerAvailable("no worker is registered")
        bad = [t for t in prompt_token_ids if not 0 <= t < info.vocab_size]
        if bad:
            raise RequestRejected(
                f"prompt token ids outside the vocabulary [0, {info.vocab_size}): {bad[:5]}"
            )
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            list(info.eos_token_ids),
            priority,
            group=group,
            cache_salt=cache_salt,
            lora_name=lora_name,
            lora_path=lora_path,
        )
        queue = queue if queue is not None else asyncio.Queue()
        refuse = self._admit(req)
        self._place(req, queue)
        if refuse is not None:
            self._refuse(*refuse)
        return queue

    # ----- admission control -----
    @property
    def num_backlog(self) -> int:
        """Requests beyond what the workers' batches hold (they wait for a slot, not just a step)."""
        planners = [s.planner for s in self.workers.values()]
        unfinished = sum(p.num_waiting + p.num_running for p in planners)
        return max(0, unfinished - sum(p.config.max_num_seqs for p in planners))

    def retry_after_s(self) -> int:
        """When a refused request is worth trying again: the time the backlog takes to drain at the
        finish rate of the last DRAIN_WINDOW_S, in whole seconds within the RETRY_AFTER_* bounds."""
        now = time.monotonic()
        done = self._finished_at
        while done and now - done[0] > DRAIN_WINDOW_S:
            done.popleft()
        if len(done) < 2:
            return RETRY_AFTER_UNKNOWN_S
        rate = len(done) / max(now - done[0], 1e-3)
        return int(min(max(round(self.num_backlog / rate), RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S))

    def _admit(self, req: Request) -> tuple[WorkerSlot, Request, Overloaded] | None:
        """Refuse a request now, before it is queued, if the mesh is full (raises Overloaded).

        Full: `max_waiting_requests` wait beyond the batches. A request still gets in when another
        choice of its caller's request is in (a request's n choices are admitted together, so that
        none is refused after another has streamed), or when its priority is better than that of a
        waiting request that has not started: that one is to be refused instead (returned, refused
        once this one is placed), with the answer it would have got arriving now. A request that
        has streamed a token is never refused.
        """
        bound = self.config.max_waiting_requests
        if not bound or self.num_backlog < bound:
            return None
        if any(s.planner.has_group(req.group) for s in self.workers.values()):
            return None
        retry = self.retry_after_s()
        victims = []
        for slot in self.workers.values():
            victim = slot.planner.refusable(req.priority)
            if victim is not None and not self._spans_workers(victim.group, slot):
                victims.append((victim.priority, victim.arrival_time, slot, victim))
        if victims:
            _, _, slot, victim = max(victims, key=lambda v: v[:2])
            why = f"a request of a better priority than {victim.priority} took its place"
            return slot, victim, Overloaded(self._full_message(bound, why, retry), retry)
        self.num_refused += 1
        why = f"none of them of a worse priority than {req.priority}"
        raise Overloaded(self._full_message(bound, why, retry), retry)

    @staticmethod
    def _full_message(bound: int, why: str, retry: int) -> str:
        waiting = f"{bound} requests wait beyond its workers' batches"
        return f"the scheduler is full ({waiting}; {why}): retry in {retry} s"

    def _spans_workers(self, group: str, slot: WorkerSlot) -> bool:
        return any(s is not slot and s.planner.has_group(group) for s in self.workers.values())

    def _refuse(self, slot: WorkerSlot, req: Request, error: Overloaded) -> None:
        """Drop a waiting request that never started; its caller gets `error` instead of tokens."""
        log.info("refusing a waiting request for a better priority", extra={"request_id": req.request_id})
        self.num_refused += 1
        slot.planner.abort(req.request_id)
        self.pd.cancel(req.request_id)
        stream = self.streams.pop(req.request_id, None)
        if stream is not None:
            stream.queue.put_nowait(error)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str = "",
    ) -> AsyncIterator[RequestDelta]:
        """Deltas until the request finishes; leaving early (cancel, error) aborts it."""
        queue = self.submit(request_id, prompt_token_ids, params, priority, cache_salt=cache_salt)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request; its queue gets a last delta (FinishReason.ABORT) so its stream ends now."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return False
        stream.flush()
        self._peeks_due.pop(request_id, None)  # ended before its first token: no peek
        handover = self.pd.cancel(request_id)
        if handover is not None and handover.task is not None:  # between the workers: on none
            stream.queue.put_nowait(handover.aborted())
            return True
        slot = self.workers.get(stream.worker_id)
        req = slot.planner.abort(request_id) if slot is not None else None
        if req is not None:
            slot.wakeup.set()
            stream.queue.put_nowait(slot.planner.delta(req, 0))
        return True

    def stats(self) -> dict:
        workers = {}
        for wid, s in self.workers.items():
            b = s.planner.blocks
            workers[wid] = {
                "running": s.planner.num_running,
                "waiting": s.planner.num_waiting,
                "kv_usage": b.usage,
                "free_blocks": b.num_free_blocks,
                "num_blocks": b.num_blocks,
                "prefix_queries": b.stats.queries,
                "prefix_hits": b.stats.hits,
                "requests_hit": b.stats.requests_hit,
                "preemptions": s.planner.num_preemptions,
                "steps": s.num_steps,
                "step_seconds": s.step_seconds,
                "connected": s.connected,
                "reconnects": s.num_reconnects,
                **dataclasses.asdict(s.planner.tiers.stats),
                "spec_num_drafts": s.planner.spec.stats.num_drafts,
                "spec_num_draft_tokens": s.planner.spec.stats.num_draft_tokens,
                "spec_num_accepted_tokens": s.planner.spec.stats.num_accepted_tokens,
                "spec_accepted_per_pos": list(s.planner.spec.stats.accepted_per_pos),
            }
        return {
            "workers": workers,
            "failovers": self.num_failovers,
            "streams": len(self.streams),
            "refused": self.num_refused,
            "backlog": self.num_backlog,
            **{f"pd_{k}": v for k, v in dataclasses.asdict(self.pd.stats).items()},
        }

    # ----- internals -----
    def _notify(self) -> None:
        for callback in self.on_workers_changed:
            callback(len(self.workers))

    def _place(self, req: Request, queue: asyncio.Queue, exclude: str | None = None, only=None) -> None:
        # Connected workers first; a lone worker being re-dialled still queues requests for its return.
        # `only(slot)`: the workers it may go to (a direct handover's: those that can copy its KV).
        req = self.pd.restore(req)  # a prefill-side request moved: its caller's params again
        slots = [s for s in self.workers.values() if s.worker_id != exclude and (only is None or only(s))]
        connected = [s for s in slots if s.connected]
        decoders, prefillers = self.pd.pools(connected or slots)
        planners = {s.worker_id: s.planner for s in decoders}
        margin = self.config.overload_margin
        choice = route(planners, req.all_token_ids, margin, req.cache_root, lora_key(req))
        if choice is None:
            raise NoWorkerAvailable("no worker is registered")
        slot = self.workers[choice.worker_id]
        uncached = req.num_tokens - choice.cached_tokens
        direct = self.config.direct_handover and any(
            direct_compatible(p.info, d.info) for p in prefillers for d in decoders
        )
        has_store = self.kv_store is not None
        if prefillers and self.pd.wants(req, uncached, slot.info.kv_chunk_blocks, has_store, direct):
            planners = {s.worker_id: s.planner for s in prefillers}
            pick = route(planners, req.all_token_ids, margin, req.cache_root, lora_key(req))
            remote = pick is not None and self.pd.remote(
                uncached, self._load(self.workers[pick.worker_id]), self._load(slot)
            )
            if remote:
                choice, slot = pick, self.workers[pick.worker_id]
                # Its blocks are held after its first token if a decode worker can copy them.
                hold = direct and any(direct_compatible(slot.info, d.info) for d in decoders)
                self.pd.send_to_prefill(req, pick.worker_id, hold)
        chunk_tokens = slot.info.kv_chunk_blocks * slot.info.block_size
        # Worth a lookup only if a whole chunk past what this worker's GPU cache holds may be there.
        wanted = chunk_tokens and req.num_tokens > choice.cached_tokens + chunk_tokens
        wanted = wanted and req.peer is None  # a direct handover copies its prompt: no store
        peek = False
        if self.kv_store is not None and wanted and not req.handed_over:  # ... and if a hit could load faster
            wanted = slot.planner.tiers.worth_looking(req.num_tokens - choice.cached_tokens)
            peek = not wanted  # its chunks may be stored all the same: asked without waiting (_peek)
        if self.kv_store is not None and wanted:
            req.kv_lookup_pending = True
        slot.planner.add_request(req)  # may raise RequestRejected
        self.streams[req.request_id] = _Stream(queue, choice.worker_id)
        if req.kv_lookup_pending:
            self._lookups.add(asyncio.get_running_loop().create_task(self._lookup(slot, req)))
        elif peek:
            self._peeks_due[req.request_id] = (slot, req)
        slot.wakeup.set()

    async def _stored_chunks(
        self, info: WorkerInfo, prompt: list[int], cache_root: bytes
    ) -> tuple[list[bytes], int]:
        """The prompt's chunk keys on a worker of `info`, and how many leading ones the KV store
        says it holds (its answer as given; raises what the lookup raised, or on its timeout)."""
        chunk = info.kv_chunk_blocks
        keys = extend_block_keys([], prompt, info.block_size, info.fingerprint, cache_root)
        chunk_keys = keys[chunk - 1 :: chunk]
        assert self.kv_store is not None
        found = await asyncio.wait_for(
            self.kv_store.lookup(store_fingerprint(info.fingerprint, chunk), chunk_keys),
            self.config.kv_lookup_timeout_s,
        )
        return chunk_keys, int(found)

    async def _lookup(self, slot: WorkerSlot, req: Request) -> None:
        """Ask the KV store how many leading chunks of the prompt it holds; the request waits meanwhile."""
        started = time.perf_counter()
        try:
            chunk_keys, found = await self._stored_chunks(slot.info, req.prompt_token_ids, req.cache_root)
            req.store_hit_blocks = min(found, len(chunk_keys)) * slot.info.kv_chunk_blocks
            # What a hit costs before any load (the load predictor weighs it).
            slot.planner.tiers.predictor.observe_lookup(time.perf_counter() - started)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the store is slow or down: compute the prefix instead
            self.num_kv_lookup_errors += 1
            log.info("kv store lookup failed", extra={"request_id": req.request_id, "error": repr(e)})
        finally:
            req.kv_lookup_pending = False
            self._lookups.discard(asyncio.current_task())  # type: ignore[arg-type]
            slot.wakeup.set()

    def _start_peek(self, delta: RequestDelta) -> None:
        """A request that skipped its lookup has its first token out (or ended): peek now."""
        slot, req = self._peeks_due.pop(delta.request_id)
        if not delta.new_token_ids:
            return  # ended before its first token: nothing of its prompt was computed to put
        slot.planner.tiers.peek_started()  # its puts wait for the answer (kv_tiers)
        peek = self._peek(slot, req.prompt_token_ids, req.cache_root)
        self._lookups.add(asyncio.get_running_loop().create_task(peek))

    async def _peek(self, slot: WorkerSlot, prompt: list[int], cache_root: bytes) -> None:
        """The lookup of a prompt that skipped its own, sent once its first token is out (a lookup
        under way would share the GIL with an in-process worker's launch) and waited for by no
        request: the chunks the store holds are remembered before the prompt's puts are attached
        (kv_tiers.peek_done), so the worker does not put them again (LMCache's non-blocking lookup)."""
        tiers = slot.planner.tiers
        held: list[bytes] = []
        try:
            await _let_deliveries_run()  # and after the token it followed has been handed on
            chunk_keys, found = await self._stored_chunks(slot.info, prompt, cache_root)
            held = chunk_keys[: max(0, found)]
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the store is slow or down: its chunks are put as before
            self.num_kv_lookup_errors += 1
            log.info("kv store peek failed", extra={"error": repr(e)})
        finally:
            tiers.peek_done(held)
            self._lookups.discard(asyncio.current_task())  # type: ignore[arg-type]
            slot.wakeup.set()  # the puts it held back may go

    def _requeue(self, dead: WorkerSlot) -> None:
        """Move every unfinished request of a worker to the others, tokens so far kept."""
        self.pd.release_decoder(dead.worker_id, planned_too=False)  # they move: recomputed
        for old in dead.planner.take_all():
            stream = self.streams.pop(old.request_id, None)
            if stream is None:
                continue
            stream.flush()  # the tokens so far go out before the request moves (they are kept)
            req = old.moved()
            try:
                self._place(req, stream.queue, exclude=dead.worker_id)
                self.num_failovers += 1
            except (NoWorkerAvailable, RequestRejected) as e:
                stream.queue.put_nowait(NoWorkerAvailable(f"worker {dead.worker_id} is unreachable and {e}"))

    async def _run(self, slot: WorkerSlot) -> None:
        """Step the worker; on any failure of its link, re-dial it or, failing that, remove it."""
        while True:
            try:
                await self._step_loop(slot)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # every way a link can break ends here: reconnect or fail over
                log.warning("worker link broke", extra={"worker_id": slot.worker_id, "error": repr(e)})
                slot.breaks_without_progress += 1
                if slot.breaks_without_progress > MAX_BREAKS_WITHOUT_PROGRESS:
                    self._fail_requests(slot, f"worker {slot.worker_id} keeps breaking on its plans: {e}")
                    slot.breaks_without_progress = 0
                if await self._reconnect(slot):
                    continue
                await self.remove_worker(slot.worker_id, reason=f"unreachable after {e!r}")
                return

    def _fail_requests(self, slot: WorkerSlot, reason: str) -> None:
        """End every request a worker holds with an error (their callers get UNAVAILABLE)."""
        log.error("failing a worker's requests", extra={"worker_id": slot.worker_id, "reason": reason})
        for req in slot.planner.take_all():
            self.pd.cancel(req.request_id)
            self._peeks_due.pop(req.request_id, None)
            stream = self.streams.pop(req.request_id, None)
            if stream is not None:
                stream.flush()
                stream.queue.put_nowait(NoWorkerAvailable(reason))

    async def _reconnect(self, slot: WorkerSlot) -> bool:
        """Re-dial with backoff; True once the link is back, False when the worker counts as dead."""
        cfg = self.config
        slot.connected = False
        self._notify()
        started = time.monotonic()
        delay, moved = 0.1, False
        while True:
            left = cfg.worker_dead_after_s - (time.monotonic() - started)
            try:
                connected = await slot.link.connect(timeout_s=max(0.5, min(5.0, left)))
            except Exception as e:  # LinkBroken, or anything a half-dead channel throws
                log.info("worker re-dial failed", extra={"worker_id": slot.worker_id, "error": str(e)})
            else:
                return self._resume(slot, connected)
            elapsed = time.monotonic() - started
            if not moved and elapsed >= cfg.failover_after_s and self.num_connected > 0:
                moved = True  # others can serve them now; this worker may come back empty
                self._requeue(slot)
            if elapsed >= cfg.worker_dead_after_s:
                return False
            slot.redial_now.clear()
            with contextlib.suppress(TimeoutError):  # asyncio.timeout, not wait_for: see _idle
                async with asyncio.timeout(min(delay, max(left, 0.01))):
                    await slot.redial_now.wait()
            delay = min(delay * 2, 2.0)

    def _resume(self, slot: WorkerSlot, connected: Connected) -> bool:
        info, old = connected.info, slot.info
        if (info.fingerprint, info.block_size, info.num_kv_blocks) != (
            old.fingerprint,
            old.block_size,
            old.num_kv_blocks,
        ):
            log.warning("worker came back with another cache layout", extra={"worker_id": slot.worker_id})
            return False
        same_process = bool(info.instance_id) and info.instance_id == old.instance_id
        slot.planner.resync(connected.last_step_id if same_process else None)
        self.pd.release_decoder(slot.worker_id, planned_too=True)  # plans lost with the link run no more
        slot.info = info
        slot.connected = True
        slot.num_reconnects += 1
        self._notify()
        slot.wakeup.set()
        log.info(
            "worker reconnected",
            extra={
                "worker_id": slot.worker_id,
                "same_process": same_process,
                "last_step": connected.last_step_id,
            },
        )
        return True

    async def _step_loop(self, slot: WorkerSlot) -> None:
        """Keep up to `depth` plans in flight; apply each result (in order) as it comes back."""
        planner = slot.planner
        depth = 2 if self.config.async_scheduling else 1
        inflight: deque[tuple[StepPlan, float]] = deque()
        slot.inflight_tokens = 0  # a new stream: plans of a broken one are not under way
        last_result_at = 0.0  # a step's busy time starts at its send or at the result before it
        while True:
            while len(inflight) < depth and planner.has_work_for_worker():
                if inflight and planner.waits_for_result():
                    break
                plan = planner.schedule()
                if plan.num_seqs == 0 and not plan.finished_ids and not plan.preempted_ids and not plan.kv:
                    break  # nothing to run until a result (or a request) comes in
                await slot.link.send(plan)
                inflight.append((plan, time.perf_counter()))
                slot.num_inflight = len(inflight)
                slot.inflight_tokens += plan.num_tokens
                if len(inflight) == 1:
                    slot.inflight_since = inflight[0][1]
            if not inflight:
                await self._idle(slot)
                continue
            result = await slot.link.recv()
            plan, sent_at = inflight.popleft()
            slot.num_inflight = len(inflight)
            slot.inflight_tokens -= plan.num_tokens
            slot.inflight_since = time.perf_counter()  # the next plan runs from here (or its send)
            if result.step_id != plan.step_id:
                raise LinkBroken(f"worker {slot.worker_id}: result {result.step_id} for plan {plan.step_id}")
            now = time.perf_counter()
            slot.step_seconds += now - sent_at
            busy_s = now - max(sent_at, last_result_at)
            planner.tiers.observe(plan, result, busy_s)  # the load predictor
            slot.step_fit.observe(plan, busy_s)  # the disaggregation queue rule
            if plan.kv.peer_copies:  # direct handovers copied: the prefill side's blocks go
                self.pd.copied(plan, result)
            last_result_at = now
            slot.num_steps += 1
            slot.breaks_without_progress = 0
            for delta in planner.update(plan, result):
                if delta.request_id in self._peeks_due:
                    self._start_peek(delta)
                self._emit(delta)

    async def _idle(self, slot: WorkerSlot) -> None:
        """Wait for work; notice meanwhile a stream that broke, so it is re-dialled before it is needed."""
        slot.wakeup.clear()
        while not slot.wakeup.is_set():
            if not slot.link.alive:
                raise LinkBroken(f"worker {slot.worker_id}: the step stream ended while idle")
            # Not wait_for: on Python 3.11 a wait_for whose event is set as the task is cancelled
            # returns normally and swallows the cancel, and a removed worker's slot task ran on.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(IDLE_LINK_CHECK_S):
                    await slot.wakeup.wait()

    def _emit(self, delta: RequestDelta) -> None:
        stream = self.streams.get(delta.request_id)
        if stream is None:
            return
        if delta.finished and delta.request_id in self.pd.pending:
            self._hand_over(delta, stream)
        if delta.finished:
            del self.streams[delta.request_id]
            self.pd.release(delta.request_id, planned_too=False)  # a hold no plan copied
            self._finished_at.append(time.monotonic())  # the drain rate (retry_after_s)
        owned = stream.held is not None
        if owned:
            stream.held.merge(delta)  # type: ignore[union-attr]
            delta, stream.held = stream.held, None  # type: ignore[assignment]
        interval = self.config.stream_interval
        if interval > 1 and stream.started and not delta.finished and len(delta.new_token_ids) < interval:
            stream.held = delta if owned else delta.copy()
            return
        stream.started = stream.started or bool(delta.new_token_ids)
        stream.queue.put_nowait(delta)

    # ----- disaggregated prefill/decode (scheduler_svc/disaggregation.py) -----
    def _wake(self, worker_id: str) -> None:
        slot = self.workers.get(worker_id)
        if slot is not None:
            slot.wakeup.set()

    def _load(self, slot: WorkerSlot) -> WorkerLoad:
        """A worker's prefill work, queued and under way, for the queue rule."""
        running_s = time.perf_counter() - slot.inflight_since if slot.inflight_tokens else 0.0
        return load_of(slot.planner, slot.inflight_tokens, running_s, slot.step_fit, self.pd.threshold)

    def _hand_over(self, delta: RequestDelta, stream: _Stream) -> None:
        """A prefill-side request sampled its first token: unless that ends it, the token streams
        on (not as the end) and the request moves to a decode worker once its KV is in the store."""
        slot = self.workers.get(stream.worker_id)
        max_len = slot.planner.config.max_model_len if slot is not None else 0
        h = self.pd.continues(delta.request_id, max_len)
        if slot is not None and delta.request_id in slot.planner.blocks.held:
            if h is None:  # done for good: nothing copies the blocks its planner held
                slot.planner.blocks.release_hold(delta.request_id)
            else:
                h.held = slot.planner.blocks
        if h is None:
            return
        delta.finish_reason = None
        h.task = asyncio.get_running_loop().create_task(self._finish_handover(h))
        self._lookups.add(h.task)

    async def _finish_handover(self, h: Handover) -> None:
        rid = h.request.request_id
        held = h.held
        try:
            complete = False
            slot = self.workers.get(h.prefill_worker)
            # Direct: a decode worker of the prefill worker's host copies the held blocks (no wait).
            decoders = self.pd.pools([s for s in self.workers.values() if s.connected])[0]
            peer = self.pd.peer_blocks(h, slot, decoders)
            if peer is None and slot is not None and self.kv_store is not None:
                alive = lambda: (s := self.workers.get(h.prefill_worker)) is not None and s.connected  # noqa: E731
                complete = await self.pd.wait_for_kv(self.kv_store, slot.info, h.request, alive)
            self.pd.pending.pop(rid, None)
            stream = self.streams.pop(rid, None)
            if stream is None:
                return  # aborted meanwhile
            stream.flush()
            req = self.pd.decode_request(h)
            only = None
            if peer is not None:
                assert slot is not None
                req.peer, src = peer, slot.info
                only = lambda s: direct_compatible(src, s.info)  # noqa: E731
            try:
                self._place(req, stream.queue, only=only)
            except (NoWorkerAvailable, RequestRejected) as e:
                stream.queue.put_nowait(NoWorkerAvailable(f"no decode worker takes request {rid}: {e}"))
                return
            if peer is not None:
                self.pd.hold(h, peer, req, self.streams[rid].worker_id)
                held = None  # the hold is the Disaggregation's now: released once copied
            self.streams[rid].started = True
            self.pd.placed(h, complete, direct=peer is not None)
            log.info(
                "request handed over",
                extra={"request_id": rid, "from": h.prefill_worker, "to": self.streams[rid].worker_id,
                       "kv_complete": complete, "direct": peer is not None,
                       "wait_s": round(time.monotonic() - h.first_token_at, 4)},
            )  # fmt: skip
        finally:
            if held is not None:  # not placed as a direct handover: nothing copies them
                held.release_hold(rid)
                self._wake(h.prefill_worker)
            self._lookups.discard(asyncio.current_task())  # type: ignore[arg-type]
