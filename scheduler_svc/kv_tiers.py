"""Planning the KV tiers below one worker's GPU cache: its host (CPU) tier and the shared KV store.

Tier 0 is the worker's GPU prefix cache (the BlockManager). Below it:
- tier 1, the worker's host tier: every block a plan computes is saved there by
  the next plan (before that plan's forward, so a block reused at once is still
  intact), into a slot this side picks (`HostBlockIndex` mirrors the tier);
- tier 2, the KV store: every completed chunk of `chunk_blocks` blocks is put
  there the same way, and looked up (by the Mesh, when a request arrives) so
  that a prefix computed on any worker is loaded instead of recomputed.

At admission, a request whose chain continues past its GPU hit in the host
tier and then in the store gets fresh blocks filled by the plan (host loads,
store loads) and computes only the rest. A store load may fail (the entry
vanished or is corrupt, the store went down): the worker then computes those
blocks itself in the same forward (it holds the tokens), so a miss costs time,
never a wrong token or a failed request, and nothing here has to roll back.
Loaded blocks are neither saved back nor put back.

A store hit is loaded only as far as loading is predicted faster than computing it
(scheduler_svc/load_predictor.py: the worker's measured load bandwidth against its measured
prefill rate); the chunks past that are computed, as for a miss.

A prompt that skips its lookup (no hit of its size could pay) is still peeked at: the Mesh sends
the same lookup without waiting for it (`peek_started` / `peek_done`), and what it finds is
remembered as in the store before the prompt's chunks are put, so a prefix the store holds is not
put again (34 MB for a 256-token chunk of an 8B model, sent by the worker's put thread after every
short prompt). Puts wait for the peeks in flight while only plans that compute nothing would
carry them; a plan that computes takes them anyway (what is known by then is filtered out): a
forward could overwrite their blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.host_cache import HostBlockIndex
from scheduler_svc.load_predictor import ERROR_BOUNDS, LoadPredictor, error_bucket
from scheduler_svc.request import Request
from services.step import KVTransfers, StepPlan, StepResult, StoreLoad, StorePut

# Chunk keys remembered as already in the store (loaded from it or put to it), most recent last.
KNOWN_CHUNKS = 1 << 16


@dataclass
class KVTierStats:
    host_hit_tokens: int = 0  # prompt tokens loaded from the worker's host tier
    store_hit_tokens: int = 0  # prompt tokens loaded from the KV store
    saved_blocks: int = 0  # blocks copied to the host tier
    stored_chunks: int = 0  # chunks put to the KV store
    failed_loads: int = 0  # sequences whose store loads failed (the worker computed them instead)
    kv_verify_failures: int = 0  # store chunks the worker refused: their MAC did not verify
    # The load predictor (load_predictor.py): loads planned with a prediction, the seconds they
    # were predicted to take, |measured - predicted| per load (a histogram: counts per bound of
    # kv_load_error_bounds, the last one +Inf, and their sum), store hits left to compute because
    # loading them was predicted slower (loads skipped whole, tokens not loaded), and the rates
    # the predictions come from (0 until measured).
    kv_load_predictions: int = 0
    kv_load_predicted_seconds: float = 0.0
    kv_load_error_bounds: list[float] = field(default_factory=lambda: list(ERROR_BOUNDS))
    kv_load_error_counts: list[int] = field(default_factory=lambda: [0] * (len(ERROR_BOUNDS) + 1))
    kv_load_error_seconds: float = 0.0
    kv_load_skipped: int = 0
    kv_load_skipped_tokens: int = 0
    kv_lookups_skipped: int = 0  # requests that skipped the store lookup: no hit could pay
    kv_load_bytes_per_second: float = 0.0
    kv_prefill_tokens_per_second: float = 0.0


@dataclass
class TierHit:
    """Where a waiting request's blocks past its GPU hit come from (block indices in its chain)."""

    keys: list[bytes] = field(default_factory=list)  # the request's chain: every full block's key
    host_slots: list[int] = field(default_factory=list)  # blocks n .. n+len-1 from host slots
    store_start: int = 0  # first block index loaded from the store
    store_end: int = 0  # one past the last
    predicted_s: float | None = None  # the load's predicted seconds (None: no prediction)
    skipped_blocks: int = 0  # blocks of the store hit left to compute (predicted slower to load)

    def num_blocks(self, num_gpu_blocks: int) -> int:
        return max(num_gpu_blocks + len(self.host_slots), self.store_end) - num_gpu_blocks


class KVTierPlanner:
    def __init__(
        self,
        blocks: BlockManager,
        num_host_blocks: int,
        chunk_blocks: int,
        predictor: LoadPredictor | None = None,
    ) -> None:
        self.blocks = blocks
        self.predictor = predictor or LoadPredictor(blocks.block_size)
        self.host = HostBlockIndex(num_host_blocks)
        self.chunk_blocks = chunk_blocks
        blocks.chunk_blocks = chunk_blocks
        self.stats = KVTierStats()
        self._kv = KVTransfers()
        # Blocks (and chunks) the last plan made full: saved / put by the next plan.
        self._pending_saves: list[tuple[int, bytes]] = []
        self._pending_puts: list[tuple[bytes, list[int]]] = []
        self._loaded_now: set[int] = set()  # blocks the plan being built loads
        # Chunks the store holds as far as this side knows: never put again. Filtering by block
        # ids alone missed loaded chunks whose blocks were registered full by a later plan (with
        # plans in flight): an 8B worker put back up to 29 of the 32 chunks it had just loaded,
        # a pinned copy each, in series with the step (~0.2 s of a 0.3 s TTFT on an H100).
        self._in_store: OrderedDict[bytes, None] = OrderedDict()
        # Per plan in flight: host keys it assigned (forgotten if the plan is lost).
        self._assigned_by_step: dict[int, list[bytes]] = {}
        # Predicted seconds of each store load of the plan being built / of each plan in flight.
        self._predicted_now: list[float | None] = []
        self._predicted_by_step: dict[int, list[float | None]] = {}
        # Plans that compute whose results have not come back (see finish_plan).
        self._in_flight: set[int] = set()
        self._peeks = 0  # lookups in flight that no request waits for (peek_started)
        self.puts_spared = 0  # chunks not put: a peek found them in the store

    @property
    def enabled(self) -> bool:
        return self.host.num_slots > 0 or self.chunk_blocks > 0

    # ----- admission -----
    def find(self, req: Request, keys: list[bytes], num_gpu_blocks: int, max_blocks: int) -> TierHit:
        """Blocks past the GPU hit that the tiers hold, at most up to block `max_blocks`.

        `keys`: the content keys of the request's full blocks.
        """
        hit = TierHit(keys)
        if num_gpu_blocks >= max_blocks:
            return hit
        if self.host.num_slots:
            hit.host_slots = self.host.leading_run(keys[num_gpu_blocks:max_blocks])
        have = num_gpu_blocks + len(hit.host_slots)
        store_end = min(req.store_hit_blocks, max_blocks)
        if store_end > have:
            # A handed-over prompt loads whole: recomputing it would stall the decode worker's batch.
            compute = req.num_tokens - have * self.blocks.block_size  # without the load
            end = store_end if req.handed_over else self._worth_loading(hit, have, store_end, compute)
            hit.store_start, hit.store_end = have, end
        self.host.pin(hit.host_slots)
        return hit

    def worth_looking(self, uncached_tokens: int) -> bool:
        """Whether a request with this many prompt tokens past its GPU hit should look the store
        up (False: no hit of that size is predicted to load faster than it computes). Decided
        from the length alone, before any RPC: a prompt the predictor would compute anyway must
        not wait for a lookup (a round trip to another host) to learn what it would skip."""
        c = self.chunk_blocks
        # The last prompt token is always computed (its logits): chunks that could be loaded.
        max_chunks = (uncached_tokens - 1) // (c * self.blocks.block_size) if c else 0
        if self.predictor.worth_looking(c, max_chunks, uncached_tokens):
            return True
        self.stats.kv_lookups_skipped += 1
        return False

    def peek_started(self) -> None:
        """A lookup no request waits for is in flight (the Mesh's peek at a prompt that skipped
        its own): saves and puts wait for it while only plans that compute nothing would carry them."""
        self._peeks += 1

    @property
    def peeking(self) -> bool:
        return self._peeks > 0

    def peek_done(self, held_chunk_keys: list[bytes]) -> None:
        """A peek answered (or failed: no keys): the chunks it found are in the store, never put."""
        self._peeks -= 1
        self._remember(held_chunk_keys)

    def _worth_loading(self, hit: TierHit, start: int, end: int, compute_tokens: int) -> int:
        """Where the store load of blocks [start, end) should end: after the leading chunks
        predicted faster to load than to compute (`start`: none of them). `compute_tokens`: the
        prompt tokens the request computes without the load."""
        c = self.chunk_blocks
        first, last = start // c, -(-end // c)
        wanted = [min(end, (k + 1) * c) - max(start, k * c) for k in range(first, last)]
        decision = self.predictor.decide(c, wanted, compute_tokens)
        hit.predicted_s, hit.skipped_blocks = decision.predicted_seconds, decision.skipped_blocks
        return start if decision.chunks == 0 else min(end, (first + decision.chunks) * c)

    def admit(self, req: Request, block_ids: list[int], num_gpu_blocks: int, hit: TierHit) -> None:
        """Add the loads of an admitted request (its blocks allocated) to the plan being built."""
        kv = self._kv
        bs = self.blocks.block_size
        for i, slot in enumerate(hit.host_slots):
            kv.load_host_slots.append(slot)
            kv.load_block_ids.append(block_ids[num_gpu_blocks + i])
        self._loaded_now.update(block_ids[num_gpu_blocks : num_gpu_blocks + len(hit.host_slots)])
        self.stats.host_hit_tokens += len(hit.host_slots) * bs
        if hit.store_end > hit.store_start:
            c = self.chunk_blocks
            first, last = hit.store_start // c, -(-hit.store_end // c)
            keys = hit.keys
            start, end = hit.store_start, hit.store_end
            targets = [block_ids[i] if start <= i < end else -1 for i in range(first * c, last * c)]
            chunk_keys = [keys[(k + 1) * c - 1] for k in range(first, last)]
            kv.store_loads.append(StoreLoad(req.request_id, chunk_keys, targets))
            self._predicted_now.append(hit.predicted_s)
            if hit.predicted_s is not None:
                self.stats.kv_load_predictions += 1
                self.stats.kv_load_predicted_seconds += hit.predicted_s
            self._remember(chunk_keys)
            self._loaded_now.update(block_ids[hit.store_start : hit.store_end])
            self.stats.store_hit_tokens += (hit.store_end - hit.store_start) * bs
        if hit.skipped_blocks:
            self.stats.kv_load_skipped += hit.store_end == hit.store_start
            self.stats.kv_load_skipped_tokens += hit.skipped_blocks * bs
            # Computed rather than loaded, but in the store all the same: never put again (an 8k
            # prompt would put 1 GiB back, its sender contending with the next steps for the GIL).
            c = self.chunk_blocks
            found = min(req.store_hit_blocks, len(hit.keys)) // c
            self._remember([hit.keys[(k + 1) * c - 1] for k in range(found)])

    # ----- the plan -----
    def finish_plan(
        self, step_id: int, keyed: list[tuple[int, bytes]], runs_forward: bool = True
    ) -> KVTransfers:
        """The transfers of plan `step_id`: last plan's saves and puts, this plan's loads.

        `keyed`: the (block, key) pairs this plan made full, saved by the next plan.
        `runs_forward`: whether the plan computes anything. One that does not (only finished ids,
        say), made behind a plan still running, carries no saves or puts: the worker launches it
        before that plan's tokens are read, and its copies and its put sender (34 MB for a
        256-token chunk of an 8B model) would delay them (a prompt that filled a chunk paid for
        its put in its first token). They go with the next plan instead: what the plan between
        runs cannot overwrite their blocks, as it runs no forward.
        """
        kv, self._kv = self._kv, KVTransfers()
        if runs_forward:
            self._in_flight.add(step_id)
        if self._predicted_now:
            self._predicted_by_step[step_id], self._predicted_now = self._predicted_now, []
        hold = not runs_forward and bool(self._in_flight or self._peeks)
        if not hold:
            self._attach_saves_and_puts(kv, step_id)
        self.host.unpin_all()
        # What this plan makes full is saved by the next one; loaded blocks are already in a tier.
        loaded = self._loaded_now
        saves = [(b, k) for b, k in keyed if b not in loaded] if self.host.num_slots else []
        chunked = self.blocks.take_newly_chunked()
        puts = [(k, ids) for k, ids in chunked if loaded.isdisjoint(ids) and k not in self._in_store]
        if hold:
            self._pending_saves += saves
            self._pending_puts += puts
        else:
            self._pending_saves, self._pending_puts = saves, puts
        self._loaded_now = set()
        return kv

    def _attach_saves_and_puts(self, kv: KVTransfers, step_id: int) -> None:
        """Give plan `step_id` the saves and puts pending (blocks the plans before it made full)."""
        assigned = []
        for block_id, key in self._pending_saves:
            slot = self.host.assign(key)
            if slot is None:
                continue
            kv.save_block_ids.append(block_id)
            kv.save_host_slots.append(slot)
            assigned.append(key)
        self.stats.saved_blocks += len(assigned)
        # Chunks learnt to be in the store since they were planned (a peek) are not put.
        puts = [(key, ids) for key, ids in self._pending_puts if key not in self._in_store]
        self.puts_spared += len(self._pending_puts) - len(puts)
        kv.store_puts = [StorePut(key, ids) for key, ids in puts]
        self._remember([key for key, _ in puts])
        self.stats.stored_chunks += len(kv.store_puts)
        if assigned:
            self._assigned_by_step[step_id] = assigned
        self._pending_saves, self._pending_puts = [], []

    def _remember(self, chunk_keys: list[bytes]) -> None:
        known = self._in_store
        for key in chunk_keys:
            known[key] = None
            known.move_to_end(key)
        while len(known) > KNOWN_CHUNKS:
            known.popitem(last=False)

    def has_pending(self) -> bool:
        """Whether saves or puts wait for a plan of their own: only while no plan that computes is
        in flight and no peek is (see finish_plan); until then they ride with the next plan that
        computes."""
        pending = self._pending_saves or self._pending_puts
        return bool(pending) and not self._in_flight and not self._peeks

    # ----- results -----
    def executed(self, step_id: int, failed_load_seq_ids: list[str], kv_verify_failures: int = 0) -> None:
        self._assigned_by_step.pop(step_id, None)
        self._in_flight.discard(step_id)
        self.stats.failed_loads += len(failed_load_seq_ids)
        self.stats.kv_verify_failures += kv_verify_failures

    def observe(self, plan: StepPlan, result: StepResult, busy_s: float) -> None:
        """Feed the load predictor what a plan's execution measured: the worker's timing of each
        store load, and `busy_s` (the scheduler's timing of the step), less those loads, as a
        prefill sample of the prompt tokens it computed. Steps after a load, which compute only
        a prompt's tail, are what tells the fixed cost of a step from its rate per token."""
        p, st = self.predictor, self.stats
        predicted = self._predicted_by_step.pop(plan.step_id, [])
        reports = zip(result.kv_load_blocks, result.kv_load_bytes, result.kv_load_seconds, strict=False)
        for i, (blocks, nbytes, seconds) in enumerate(reports):
            p.observe_load(blocks, nbytes, seconds)
            guess = predicted[i] if i < len(predicted) else None
            if guess is not None and blocks:
                error = abs(seconds - guess)
                st.kv_load_error_counts[error_bucket(error)] += 1
                st.kv_load_error_seconds += error
        # Host loads overlap the forward (a side stream); a failed store load computed more than
        # the plan says: neither step is a clean sample.
        if not plan.kv.load_block_ids and not result.failed_load_seq_ids:
            p.observe_prefill(plan.num_prompt_tokens, max(0.0, busy_s - sum(result.kv_load_seconds)))
        st.kv_load_bytes_per_second = p.bytes_per_second
        st.kv_prefill_tokens_per_second = p.prefill_tokens_per_second

    def resync(self, last_executed_step_id: int | None) -> None:
        """The worker's link broke: plans after `last_executed_step_id` never ran (None: a new process)."""
        if last_executed_step_id is None:
            self.host.clear()
        else:
            for step_id, keys in self._assigned_by_step.items():
                if step_id > last_executed_step_id:
                    self.host.forget(keys)
        self._assigned_by_step.clear()
        self._in_flight.clear()
        self._predicted_by_step.clear()
        self._predicted_now = []
        self._pending_saves.clear()
        self._pending_puts.clear()
        self._kv = KVTransfers()
        self._loaded_now = set()
        self.host.unpin_all()
