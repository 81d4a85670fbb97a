"""Disaggregated prefill/decode: which worker computes a prompt, and the KV handover to a decode worker.

Worker roles (`WorkerInfo.role`, the worker's `--role`): a "prefill" worker computes prompts
and samples their first token; a "decode" or "both" worker takes the decode of handed-over
requests and whole requests too short to hand over. A pool with no prefill worker serves
every request whole, as before; one with prefill workers only serves whole requests there.

Per request, Dynamo's conditional disaggregation, both halves (its router sends a prefill remote
when it is longer than `max_local_prefill_length` and the prefill queue is shorter than
`max_prefill_queue_size`):
1. Length: a request is a candidate for a prefill worker when the prompt tokens its decode worker
   would have to compute (those not in its GPU cache or host tier) reach `threshold`, and it is a
   plain generation: no output yet (a moved request continues where it is), more than one token
   wanted, no prompt logprobs, not pooling, and a way to hand the KV over (a KV store, or a decode
   worker that copies directly). Short prompts stay whole on the decode worker: their prefill costs
   the decode batch less than a handover would.
2. Queues (`QueueRule`): a candidate still stays on its decode worker when the prefill worker's
   predicted queue wait is over `max_queue_s` (--disaggregation-max-queue-s) *and* its predicted
   time to first token there is lower than on the prefill worker. Both predictions come from what
   the scheduler measures and plans (`WorkerLoad`): each worker's prompt tokens placed but not
   planned yet, those of its plans in flight (less what the head plan has already run), and its
   step time fitted as `a + b * tokens` over its latest steps that computed prompt tokens
   (`StepFit`, a median fit: a step that compiled a kernel for a new shape takes seconds, and a
   least-squares line through it would mispredict every wait after). The prefill side drains its queue
   and then the prompt in steps of up to its step budget; the decode side computes the prompt in
   chunks of at most its `long_prefill_token_threshold` (--disaggregation-local-chunk-tokens, set
   on --role decode workers only), one chunk per step beside its decode batch, so a step with a
   chunk in it stays within the ITL budget (vLLM's long_prefill_token_threshold is the model).
   The bias is towards disaggregating, since the decode batch's ITL is what it protects: a short
   predicted wait always goes to the prefill worker, whatever the decode side could do; a decode
   worker keeps at most one long prompt in progress (vLLM's max_long_partial_prefills = 1: two
   would put two chunks in a step); one whose chunks are not bounded keeps none; and until the
   prefill worker's steps are measured, nothing is predicted and the prompt goes there. Every
   decision is counted by where it went and why (`DisaggregationStats.decisions`, the
   llmesh:pd_decisions counter with its `to` and `reason` labels).

The direct handover (one host; vLLM's NixlConnector is the model): where a decode worker can copy
out of the prefill worker's cache (`direct_compatible`: same host, an export it opens, the same
fingerprint), the prefill-side request holds its blocks when its first token finishes it (its
planner moves its block table to `BlockManager.held`); the request (prompt + first token) is placed
at once on such a decode worker with the held block ids (`Request.peer`); that worker's admission
allocates the prompt's blocks and its plan carries a `PeerCopy` (worker_svc/kv_peer.py copies the
whole prompt, the last partial block too, so it computes the first token only, on the prefill
worker's KV bit for bit); once that plan's result is back the prefill side's blocks are freed
(`copied`). A copy that fails on the worker is computed there in the same forward. A hold whose
copy was never planned goes when the request ends or is aborted, when the prefill worker leaves
(then the decode worker computes the prompt), or after HOLD_MAX_S; one whose copy a plan makes is
freed only once that plan's result is in or the plan is known lost (the decode worker reconnected
or is gone), so a free never races a copy.

Otherwise (another host, no export, --no-direct-handover) the handover goes through the KV store,
reusing what every worker already does:
1. the prefill worker gets the request with max_tokens = 1 (its caller's parameters kept here):
   it computes the prompt, puts each completed chunk into the store (as any worker does, from a
   background thread after the step) and samples the first token, which streams to the caller
   from there (time to first token is the prefill side's);
2. its planner finishes it there (its blocks go back to its prefix cache). The stream stays open
   while the mesh waits until the store holds the prompt's complete chunks, at most
   `timeout_s`, and not at all once the prefill worker is gone;
3. the request (prompt + first token, its caller's parameters, the same id and stream) is placed
   on a decode worker, whose admission looks the prompt up in the store, loads the chunks and
   computes only the tail: the prompt's last partial chunk and the first token.

Every failure ends in a recompute, never a wrong token: a chunk missing or corrupt in the store is
computed by the decode worker (the worker's store-load fallback); a prefill worker lost before its
first token moves the request elsewhere with its caller's parameters (as any failover); one lost
after it leaves the decode worker to compute what the store lacks; a decode worker lost moves
its requests to another decode worker (prompt + tokens so far, as any failover).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from scheduler_svc.prefix_hash import extend_block_keys
from scheduler_svc.request import FinishReason, PeerBlocks, Request, RequestDelta
from services.sampling_params import SamplingParams
from services.step import PeerCopy, StepPlan, StepResult, WorkerInfo, store_fingerprint

if TYPE_CHECKING:
    from scheduler_svc.block_manager import BlockManager
    from scheduler_svc.mesh import WorkerSlot

log = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
# A direct handover's blocks stay held on the prefill worker at most this long before a decode
# plan copies them; past it the decode worker computes the prompt (the prefill worker's cache
# must not fill up with the prompts of a decode worker that does not admit them).
HOLD_MAX_S = 30.0
# Polling the store for a handover's chunks: first interval, then doubled up to the last.
POLL_FIRST_S, POLL_MAX_S = 0.002, 0.01


# Why a candidate (a long plain generation) went where it did: the `reason` label of the decisions.
TO_PREFILL, TO_DECODE = "prefill", "decode"
SHORT_PROMPT = "short_prompt"  # under the threshold: kept whole on the decode worker
QUEUE_SHORT = "queue_short"  # the prefill worker's predicted wait is within the bound
QUEUE_LONG = "queue_long"  # ... over it, and the decode worker predicted to give the first token sooner
PREFILL_FASTER = "prefill_faster"  # ... over it, yet the prefill worker still predicted sooner
UNMEASURED = "unmeasured"  # no step time measured on the prefill worker yet: nothing to predict
DECODE_BUSY = "decode_busy"  # the decode worker already computes a long prompt of its own
DECODE_UNBOUNDED = "decode_unbounded"  # its chunks are not bounded: a long prompt would stall it


class ChunkLookup(Protocol):
    async def lookup(self, fingerprint: bytes, keys: list[bytes]) -> int: ...


def is_prefill_only(info: WorkerInfo) -> bool:
    return info.role == "prefill"


def direct_compatible(src: WorkerInfo, dst: WorkerInfo) -> bool:
    """Whether `dst` can copy blocks straight out of `src`'s cache: `src` exports it, both are on
    one host, `dst` opens that kind of export, and their blocks are alike (the fingerprint holds
    the model, dtype, block size, layers and head layout)."""
    e = src.kv_export
    if e is None or not e.host_id or e.host_id != dst.host_id or e.kind != dst.kv_peer_import:
        return False
    return src.fingerprint == dst.fingerprint and src.block_size == dst.block_size


def usable_peer(req: Request, block_size: int, num_tokens: int) -> PeerBlocks | None:
    """The request's peer blocks if they cover its prompt (None: none, or they are dropped)."""
    p = req.peer
    if p is None:
        return None
    if not 0 < p.num_tokens < num_tokens or len(p.block_ids) < -(-p.num_tokens // block_size):
        req.peer = None  # never planned: the hold goes when the request does
        return None
    return p


def peer_copy(req: Request, peer: PeerBlocks, block_ids: list[int], num_gpu_blocks: int, bs: int) -> PeerCopy:
    """The plan's copy of the prompt's blocks past the decode worker's own prefix hit, the last
    partial one included: the decode worker then computes only the first token, on KV that is
    bit for bit the prefill worker's (as an aggregated worker's would be)."""
    n = -(-peer.num_tokens // bs)
    peer.planned = True
    req.peer = None  # copied by this plan or never: a restart computes the prompt
    src, dst = peer.block_ids[num_gpu_blocks:n], block_ids[num_gpu_blocks:n]
    return PeerCopy(req.request_id, peer.export, src, dst)


# Steps a StepFit keeps (the latest), and the fewest prompt tokens a step must compute to be one.
STEP_FIT_WINDOW = 32
STEP_FIT_MIN_TOKENS = 32


class StepFit:
    """A worker's step seconds as `a + b * prompt tokens`, fitted by medians over its latest steps
    that computed prompt tokens (Theil-Sen: the slope is the median of the pairwise slopes, the
    intercept the median residual), so the odd slow step (a kernel compiled for a new shape, a
    host hiccup) moves it little. Where the steps span one size only, or time does not grow with
    tokens, it is flat at their median (a decode worker's steps, bound by their decodes)."""

    def __init__(self, window: int = STEP_FIT_WINDOW) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, plan: StepPlan, busy_s: float) -> None:
        """A step's result: its prompt tokens (new sequences and chunks of more than one token)
        and the worker's busy time for it. Steps that loaded KV from a tier spent it elsewhere."""
        if plan.kv.load_block_ids or plan.kv.store_loads or plan.kv.peer_copies:
            return
        tokens = plan.num_prompt_tokens
        if tokens >= STEP_FIT_MIN_TOKENS and busy_s > 0:
            self.samples.append((tokens, busy_s))

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b); None before the first step."""
        if not self.samples:
            return None
        pts = list(self.samples)
        slopes = [
            (y1 - y0) / (x1 - x0) for i, (x0, y0) in enumerate(pts) for x1, y1 in pts[i + 1 :] if x1 != x0
        ]
        b = max(0.0, statistics.median(slopes)) if slopes else 0.0
        a = max(0.0, statistics.median(y - b * x for x, y in pts))
        return a, b


@dataclass
class WorkerLoad:
    """What the queue rule knows of one worker's prefill work, as the scheduler sees it."""

    queued_tokens: int  # prompt tokens placed on it that no plan has scheduled yet
    inflight_tokens: int = 0  # tokens of its plans in flight
    inflight_s: float = 0.0  # how long the oldest of those has been running
    # A step's seconds fitted as a + b * tokens over its steps that computed prompt tokens; None:
    # not measured yet.
    fit: tuple[float, float] | None = None
    step_tokens: int = 2048  # most prompt tokens one request computes in a step
    chunk_bounded: bool = False  # its planner bounds each request's chunk (a decode worker's)
    long_prefilling: bool = False  # a long prompt is being computed there (or waits to be)

    def seconds(self, tokens: int, fit: tuple[float, float] | None = None) -> float:
        """Predicted seconds to compute `tokens` prompt tokens in steps of up to `step_tokens`."""
        a, b = fit or self.fit or (0.0, 0.0)
        return -(-tokens // max(1, self.step_tokens)) * a + b * tokens if tokens > 0 else 0.0

    def inflight_left_s(self, fit: tuple[float, float] | None = None) -> float:
        """Predicted seconds until its plans in flight are done."""
        return max(0.0, self.seconds(self.inflight_tokens, fit) - self.inflight_s)

    def wait_s(self) -> float:
        """Predicted seconds until a prompt placed now starts: what is in flight, then the queue."""
        return self.inflight_left_s() + self.seconds(self.queued_tokens)


def load_of(planner, inflight_tokens: int, inflight_s: float, fit: StepFit, long_tokens: int) -> WorkerLoad:
    """A worker's load from its planner (requests placed, their prompt tokens not scheduled yet),
    its plans in flight and its step fit. `long_tokens`: a prompt this long is a long one (the
    disaggregation threshold)."""
    queued, long_prefilling = 0, False
    for r in planner.requests.values():
        left = r.num_tokens - r.num_computed_tokens
        if left > 1 and not r.handed_over:  # a decode has one token pending at most; a handover
            queued += left  # copies or loads its prompt
            long_prefilling = long_prefilling or r.num_tokens >= long_tokens
    cfg = planner.config
    step = cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens
    bounded = cfg.long_prefill_token_threshold > 0
    coefficients = fit.coefficients()
    return WorkerLoad(queued, inflight_tokens, inflight_s, coefficients, step, bounded, long_prefilling)


@dataclass
class DisaggregationStats:
    handovers: int = 0  # requests moved from a prefill worker to a decode worker
    handover_seconds: float = 0.0  # sum over handovers: first token out -> placed on the decode worker
    # Handovers whose prompt KV was not all in the store when placed (the prefill worker was lost,
    # a put was dropped or late): the decode worker computes what is missing.
    fallbacks: int = 0
    kept_whole: int = 0  # requests a prefill worker could have taken, kept whole (short prompt)
    disaggregated: int = 0  # requests sent to a prefill worker
    # Direct handovers (the decode worker copied the prefill worker's blocks): how many, those
    # whose copy failed (recomputed), the bytes copied and the decode workers' seconds for it.
    direct: int = 0
    direct_failed: int = 0
    direct_bytes: int = 0
    direct_copy_seconds: float = 0.0
    # Candidates by where they went and why ("prefill/queue_short", "decode/queue_long", ...).
    decisions: dict[str, int] = field(default_factory=dict)


@dataclass
class Hold:
    """A prefill worker's blocks held for a direct handover until the decode worker copied them."""

    blocks: BlockManager  # the prefill worker's (the held table is under the request id)
    peer: PeerBlocks  # the decode-side request's, `planned` once a plan copies it
    request: Request  # the decode-side request
    decode_worker: str
    expiry: asyncio.TimerHandle | None = None


@dataclass
class Handover:
    """A request on (or coming back from) a prefill worker."""

    request: Request  # the prefill-side request (max_tokens = 1)
    params: SamplingParams  # its caller's
    prefill_worker: str
    first_token_at: float = 0.0
    task: asyncio.Task | None = None
    # The prefill worker's planner held the prompt's blocks (a direct handover may copy them).
    held: BlockManager | None = None

    def aborted(self) -> RequestDelta:
        """The last delta of a request aborted between the two workers."""
        req = self.request
        n_prompt, n_out = len(req.prompt_token_ids), len(req.output_token_ids)
        return RequestDelta(req.request_id, [], [], FinishReason.ABORT, n_prompt, n_out)


class Disaggregation:
    def __init__(self, threshold: int, timeout_s: float, max_queue_s: float = 0.1) -> None:
        self.threshold = threshold
        self.timeout_s = timeout_s
        self.max_queue_s = max_queue_s
        self.pending: dict[str, Handover] = {}
        self.holds: dict[str, Hold] = {}  # direct handovers placed, by request id
        self.stats = DisaggregationStats()
        # The queue rule's latest prediction (seconds): the prefill worker's wait, the first token
        # there and on the decode worker.
        self.last_prediction: tuple[float, float, float] | None = None
        # Called with a prefill worker's id when held blocks of its go back: its planner may now
        # admit a prompt that waited for them (the Mesh wakes its step loop).
        self.on_freed: Callable[[str], None] = lambda worker_id: None

    # ----- routing -----
    @staticmethod
    def pools(slots: list[WorkerSlot]) -> tuple[list[WorkerSlot], list[WorkerSlot]]:
        """(decode pool, prefill pool): whole and decode work never goes to a prefill worker,
        unless no other worker is there (then the prefill workers serve whole requests)."""
        prefill = [s for s in slots if is_prefill_only(s.info)]
        decode = [s for s in slots if not is_prefill_only(s.info)]
        return (decode, prefill) if decode else (prefill, [])

    def wants(
        self, req: Request, uncached_tokens: int, chunk_blocks: int, has_store: bool, direct: bool = False
    ) -> bool:
        """Whether a request whose decode worker lacks `uncached_tokens` of it goes to a prefill
        worker. `direct`: a decode worker can copy a prefill worker's blocks (no store needed)."""
        sp = req.sampling_params
        plain = not (req.output_token_ids or req.computes_whole_prompt or sp.max_tokens == 1)
        if not (plain and ((has_store and chunk_blocks) or direct)):
            return False
        if uncached_tokens < self.threshold:
            self.stats.kept_whole += 1
            self.decided(TO_DECODE, SHORT_PROMPT)
            return False
        return True

    def remote(self, uncached_tokens: int, prefill: WorkerLoad, decode: WorkerLoad) -> bool:
        """The queue rule, for a candidate `wants` let through: whether its prefill goes to the
        prefill worker of load `prefill` (True) or stays on its decode worker of load `decode`,
        in chunks of its `step_tokens` (False). Counted by reason either way."""
        n = uncached_tokens
        if prefill.fit is None:
            return self.decided(TO_PREFILL, UNMEASURED)
        wait = prefill.wait_s()
        ttft_prefill = wait + prefill.seconds(n)
        # The decode worker's fixed cost per step (its decode batch) from its own fit, and a rate
        # per token no better than the prefill worker's (the same model on the same kind of
        # device, in larger steps): its steps compute a few short prompts beside their decodes,
        # whose slope is noise more often than not.
        a, b = decode.fit or prefill.fit
        fit = (a, max(b, prefill.fit[1]))
        # Its queued prompts (chats) share the steps with the chunks: they cost their tokens.
        ttft_decode = decode.inflight_left_s(fit) + fit[1] * decode.queued_tokens + decode.seconds(n, fit)
        self.last_prediction = (wait, ttft_prefill, ttft_decode)
        if wait <= self.max_queue_s:
            return self.decided(TO_PREFILL, QUEUE_SHORT)
        if not decode.chunk_bounded:
            return self.decided(TO_PREFILL, DECODE_UNBOUNDED)
        if decode.long_prefilling:
            return self.decided(TO_PREFILL, DECODE_BUSY)
        if ttft_decode < ttft_prefill:
            return not self.decided(TO_DECODE, QUEUE_LONG)
        return self.decided(TO_PREFILL, PREFILL_FASTER)

    def decided(self, to: str, reason: str) -> bool:
        key = f"{to}/{reason}"
        self.stats.decisions[key] = self.stats.decisions.get(key, 0) + 1
        return True

    def send_to_prefill(self, req: Request, worker_id: str, hold: bool = False) -> None:
        """Make `req` a prefill-side request: it ends after its first token (its params kept here).
        `hold`: its blocks stay held then, for a decode worker to copy (a direct handover)."""
        sp = req.sampling_params
        self.pending[req.request_id] = Handover(req, sp, worker_id)
        req.hold_blocks = hold
        # min_tokens stays 1 where it was more: the first token is sampled with EOS masked alike.
        req.sampling_params = replace(sp, max_tokens=1, min_tokens=min(sp.min_tokens, 1))
        self.stats.disaggregated += 1

    def restore(self, req: Request) -> Request:
        """A request placed again (a failover, the handover itself) runs with its caller's params."""
        h = self.pending.get(req.request_id)
        if h is not None and (h.task is None or h.task is asyncio.current_task()):
            del self.pending[req.request_id]
            req.sampling_params = h.params
        return req

    # ----- the handover -----
    def continues(self, request_id: str, max_model_len: int) -> Handover | None:
        """The handover of a prefill-side request that just finished, or None if it is done for good
        (EOS or a stop token as its first token, the context full): then its caller hears the end."""
        h = self.pending.get(request_id)
        if h is None:
            return None
        req, max_tokens = h.request, h.params.max_tokens
        more = max_tokens is None or len(req.output_token_ids) < max_tokens
        if req.finish_reason is FinishReason.LENGTH and more and req.num_tokens < max_model_len:
            h.first_token_at = time.monotonic()
            return h
        del self.pending[request_id]
        return None

    def decode_request(self, h: Handover) -> Request:
        """The request as the decode worker gets it: prompt + first token, its caller's params."""
        return h.request.moved(h.params, handed_over=True)

    async def wait_for_kv(
        self, store: ChunkLookup, info: WorkerInfo, req: Request, alive: Callable[[], bool]
    ) -> bool:
        """Wait until the store holds every complete chunk of the prompt (True), or give up (False):
        after `timeout_s`, once the prefill worker is gone, or when the store does not answer."""
        chunk = info.kv_chunk_blocks
        prompt = req.prompt_token_ids
        keys = extend_block_keys([], prompt, info.block_size, info.fingerprint, req.cache_root)
        chunk_keys = keys[chunk - 1 :: chunk]
        if not chunk_keys:
            return True
        fingerprint = store_fingerprint(info.fingerprint, chunk)
        deadline = time.monotonic() + self.timeout_s
        delay = POLL_FIRST_S
        while True:
            try:
                if await store.lookup(fingerprint, chunk_keys) >= len(chunk_keys):
                    return True
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the store is down: the decode worker computes the prompt
                log.info("kv store lookup failed", extra={"request_id": req.request_id, "error": repr(e)})
                return False
            if not alive() or time.monotonic() + delay > deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def placed(self, h: Handover, complete: bool, direct: bool = False) -> None:
        self.stats.handovers += 1
        self.stats.handover_seconds += time.monotonic() - h.first_token_at
        self.stats.direct += direct
        if not (complete or direct):
            self.stats.fallbacks += 1

    def cancel(self, request_id: str) -> Handover | None:
        """The request was aborted: forget it, stop its handover, let go of its held blocks."""
        h = self.pending.pop(request_id, None)
        if h is not None and h.task is not None and h.task is not asyncio.current_task():
            h.task.cancel()
        if h is not None and h.held is not None:  # never placed: no plan copies them
            h.held.release_hold(request_id)
            self.on_freed(h.prefill_worker)
        self.release(request_id, planned_too=False)
        return h

    # ----- direct handovers: the prefill worker's held blocks -----
    def peer_blocks(
        self, h: Handover, src: WorkerSlot | None, decoders: list[WorkerSlot]
    ) -> PeerBlocks | None:
        """The held prompt blocks a decode worker may copy, if the prefill worker is still there
        (connected) and a decode worker can copy from it; None: the store path (or a recompute)."""
        rid = h.request.request_id
        if h.held is None or src is None or not src.connected or src.planner.blocks is not h.held:
            return None
        if not any(direct_compatible(src.info, d.info) for d in decoders):
            return None
        table = h.held.held.get(rid)
        export = src.info.kv_export
        if table is None or export is None:
            return None
        n = len(h.request.prompt_token_ids)
        return PeerBlocks(src.worker_id, export, list(table.block_ids), n)

    def hold(self, h: Handover, peer: PeerBlocks, req: Request, decode_worker: str) -> None:
        """The decode-side request `req` was placed with `peer`: hold until its copy has run."""
        assert h.held is not None
        rid = req.request_id
        hold = Hold(h.held, peer, req, decode_worker)
        hold.expiry = asyncio.get_running_loop().call_later(HOLD_MAX_S, self.release, rid, False)
        self.holds[rid] = hold

    def release(self, request_id: str, planned_too: bool = True) -> None:
        """Free a direct handover's held blocks; one whose copy a plan in flight makes only with
        `planned_too` (its result is in, or that plan is lost for good). Idempotent."""
        hold = self.holds.get(request_id)
        if hold is None or (hold.peer.planned and not planned_too):
            return
        del self.holds[request_id]
        if hold.expiry is not None:
            hold.expiry.cancel()
        if hold.request.peer is hold.peer:
            hold.request.peer = None  # not copied yet: its decode worker computes the prompt
        hold.blocks.release_hold(request_id)
        self.on_freed(hold.peer.worker_id)

    def release_decoder(self, worker_id: str, planned_too: bool) -> None:
        """A decode worker's link broke (`planned_too` False: its plans may still run) or it is
        gone or back (True: what it ran is known)."""
        for rid in [r for r, hold in self.holds.items() if hold.decode_worker == worker_id]:
            self.release(rid, planned_too)

    def peer_gone(self, worker_id: str) -> None:
        """A prefill worker left: copies not planned yet become recomputes."""
        for rid in [r for r, hold in self.holds.items() if hold.peer.worker_id == worker_id]:
            self.release(rid, planned_too=False)

    def copied(self, plan: StepPlan, result: StepResult) -> None:
        """A decode worker's plan with peer copies ran: count them, free the prefill side's blocks."""
        failed = set(result.failed_peer_seq_ids)
        for c in plan.kv.peer_copies:
            self.stats.direct_failed += c.seq_id in failed
            self.release(c.seq_id)
        self.stats.direct_bytes += result.peer_copy_bytes
        self.stats.direct_copy_seconds += result.peer_copy_seconds
