"""Step planning for one worker: continuous batching with chunked prefill and preemption.

Each step spends a token budget: running requests first (decodes, then the rest
of chunked prefills), then waiting requests in policy order. When blocks run
out, the newest (or lowest-priority) running request is preempted: its blocks
are freed and it is recomputed later from prompt + tokens so far, usually
cheaply, because its full blocks stay in the prefix cache until evicted.

The planner knows no transport: it hands out `StepPlan`s and takes `StepResult`s.

Plans may be in flight (asynchronous scheduling): `schedule()` can be called
again before the previous plan's result is back. It counts a scheduled chunk
as computed at once, and a chunk that reaches a sequence's end as one pending
token, which the worker samples and feeds to the next plan itself: a decode
needs no token value to be planned. `update()` then appends the sampled token
a step late. A sequence that turns out to have finished (EOS, a stop token)
was scheduled one step too many: that token is dropped and never reaches a
caller. Sequences at max_tokens or the context length, counting pending
tokens, are not scheduled again.

Speculative decoding (`scheduler_svc.spec_decode`): a plan may ask the worker to
propose draft tokens after a sequence's sample, and the next plan then schedules
them as extra tokens to verify. Its next position depends on how many drafts are
accepted: with drafts made ahead (n-gram) the next plan chains one more verification
behind the one in flight (the worker, which applies each result before the next plan,
resolves the positions); otherwise it waits for the result. `update()` sets its computed
length from the tokens it gained.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.disaggregation import peer_copy, usable_peer
from scheduler_svc.kv_tiers import KVTierPlanner
from scheduler_svc.lora import LoRAMirror
from scheduler_svc.prefix_hash import ROOT_KEY, extend_block_keys
from scheduler_svc.request import FinishReason, Request, RequestDelta, RequestStatus
from scheduler_svc.spec_decode import SpecDecodePolicy
from services.config import option
from services.step import NewSequence, PeerCopy, PromptLogprobs, ScheduledSequence, StepPlan, StepResult


@dataclass
class PlannerConfig:
    max_num_seqs: int = option(
        0, help="most sequences in one step (0: the worker's, vLLM's default for its device; else 64)"
    )
    max_num_batched_tokens: int = option(
        0, help="most tokens in one step (0: the worker's suggestion for its device; else 2048)"
    )
    max_model_len: int = 0  # 0 = the worker's (model's) context length
    # Longest prefill chunk one request may take in a step (0 = the whole budget).
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority"
    chain_verifications: bool = option(
        True,
        help="n-gram speculation: plan a verification behind the one in flight when most running "
        "sequences await a result (false: wait for the result; an A/B switch for the GPU)",
    )

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_num_seqs < 0 or self.max_num_batched_tokens < 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive (0: the worker's)")

    def for_worker(self, max_num_seqs: int, max_num_batched_tokens: int) -> PlannerConfig:
        """These limits, the unset ones (0) taken from a worker's suggestion (or 64 and 2048)."""
        return dataclasses.replace(
            self,
            max_num_seqs=self.max_num_seqs or max_num_seqs or 64,
            max_num_batched_tokens=self.max_num_batched_tokens or max_num_batched_tokens or 2048,
        )


def tokens_of(req: Request):
    """The request's token list, built only if the block manager needs it (a block fills)."""
    return lambda: req.all_token_ids


class SpecEntry(NamedTuple):
    """A sequence's speculation in one plan in flight."""

    drafts: int  # drafts it verifies
    propose: int  # drafts it asks the worker to propose after sampling
    num_new: int  # tokens the plan computes for it
    holds: bool  # its next position depends on this plan's result
    # Of `drafts`, those the worker proposed (a chained plan counts on a proposal not yet
    # reported; the worker fills a shorter one up with repeats, which are no evidence).
    proposed: int


class RequestRejected(ValueError):
    """The request can never run here (too long for the context or the KV cache)."""


class Planner:
    def __init__(
        self,
        config: PlannerConfig,
        blocks: BlockManager,
        tiers: KVTierPlanner | None = None,
        spec: SpecDecodePolicy | None = None,
    ) -> None:
        self.config = config.for_worker(0, 0)  # limits left unset and no worker's: 64 and 2048
        self.blocks = blocks
        # Speculative decoding with the worker's num_speculative_tokens (0: off).
        self.spec = spec if spec is not None else SpecDecodePolicy(0)
        # The worker's host tier and the KV store below its GPU cache (disabled: no slots, no store).
        self.tiers = tiers if tiers is not None else KVTierPlanner(blocks, 0, 0)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # in policy order
        self.running: list[Request] = []  # in admission order
        self._on_worker: set[str] = set()  # sequences whose state the worker holds
        self._to_drop: list[str] = []  # finished/aborted since the last plan
        self._to_preempt: list[str] = []
        self._step_id = 1  # 0 is the wire's sync plan
        # Prefix-cache keys each plan in flight registers: forgotten if the plan is lost.
        self._keyed_by_step: dict[int, list[tuple[int, bytes]]] = {}
        # Sequences each plan in flight samples for, with their incarnation (a preempted request's
        # old plans must not touch its new life).
        self._sampling_by_step: dict[int, dict[str, int]] = {}
        # Per plan in flight: sequences that verify drafts or propose them (SpecEntry).
        self._spec_by_step: dict[int, dict[str, SpecEntry]] = {}
        self._peer_copies: list[PeerCopy] = []  # direct handovers' copies of the plan being built
        # Running sequences per group (a caller's request with its n choices), for fair admission.
        self._group_running: Counter[str] = Counter()
        self._groups: Counter[str] = Counter()  # unfinished sequences per group
        self.num_preemptions = 0
        self.loras = LoRAMirror()  # the worker's LoRA slots (Mesh.add_worker sets their number)

    # ----- requests -----
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise RequestRejected(f"duplicate request id {req.request_id!r}")
        if not req.prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        limit = self.config.max_model_len
        if req.num_tokens >= limit:
            raise RequestRejected(
                f"prompt of {req.num_tokens} tokens leaves no room in max_model_len {limit}"
            )
        if not self.config.enable_chunked_prefill and req.num_tokens > self.config.max_num_batched_tokens:
            raise RequestRejected(
                f"prompt of {req.num_tokens} tokens exceeds max_num_batched_tokens "
                f"{self.config.max_num_batched_tokens} and chunked prefill is off"
            )
        # A pooling request holds its prompt's blocks only (it generates nothing).
        max_tokens = 0 if req.is_pooling else req.sampling_params.max_tokens or limit
        longest = min(req.num_tokens + max_tokens, limit)
        if self.blocks.blocks_needed(longest) > self.blocks.num_blocks:
            raise RequestRejected(
                f"{longest} tokens need more KV blocks than the cache holds ({self.blocks.num_blocks})"
            )
        self.requests[req.request_id] = req
        self._groups[req.group] += 1
        self._enqueue(req, front=False)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, FinishReason.ABORT)
        return req

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_group(self, group: str) -> bool:
        """Whether a sequence of this group (a caller's request: its n choices) is unfinished here."""
        return group in self._groups

    def refusable(self, priority: int) -> Request | None:
        """The waiting request admission control may refuse to let one of `priority` in (Mesh._admit).

        The worst by (priority, arrival) of those with a worse (higher) priority that never ran (no
        token, no step: its caller has seen nothing yet) and are their group's only sequence here
        (refusing one of n choices ends them all); None if there is none.
        """
        worst = None
        for req in self.waiting:
            if req.priority <= priority or req.status is not RequestStatus.WAITING:
                continue
            if req.output_token_ids or req.num_cached_tokens >= 0 or self._groups[req.group] > 1:
                continue
            if worst is None or (req.priority, req.arrival_time) > (worst.priority, worst.arrival_time):
                worst = req
        return worst

    @property
    def num_running(self) -> int:
        return len(self.running)

    def cached_prefix_tokens(self, token_ids: list[int], root: bytes = ROOT_KEY) -> int:
        """Leading tokens of a prompt this worker holds: in its GPU cache, then its host tier.

        `root`: the root of the prompt's key chain (its cache salt): other salts' blocks don't count.
        """
        blocks = self.blocks
        if not blocks.enable_prefix_caching:
            return 0
        keys = extend_block_keys([], token_ids, blocks.block_size, blocks.fingerprint, root)
        n = len(blocks.longest_cached_prefix(token_ids, keys))
        if self.tiers.host.num_slots:
            n += self.tiers.host.count_run(keys[n:])
        return n * blocks.block_size

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def waits_for_result(self) -> bool:
        """Most running sequences await a plan's result (speculative decoding): a plan made now
        would hold only the rest, and the two groups would then alternate, each in every other
        step. Better to wait for the result and plan them all together, unless they can chain
        behind it (then nobody waits)."""
        if not self._most_await():
            return False
        return not self.config.chain_verifications or not any(
            r.awaiting_result and self._chained_drafts(r, 1 << 30) is not None for r in self.running
        )

    def _most_await(self) -> bool:
        awaiting = sum(1 for r in self.running if r.awaiting_result)
        return awaiting > 0 and 2 * awaiting >= len(self.running) and not self.waiting

    def has_work_for_worker(self) -> bool:
        return self.has_unfinished() or bool(self._to_drop or self._to_preempt) or self.tiers.has_pending()

    # ----- planning -----
    def schedule(self) -> StepPlan:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        chunk = cfg.long_prefill_token_threshold or budget
        plan = StepPlan(step_id=self._step_id)
        self._step_id += 1
        self._sampling = self._sampling_by_step[plan.step_id] = {}
        self._spec = self._spec_by_step[plan.step_id] = {}
        preempted = False

        # Verifications chain behind those in flight only where the plan would otherwise wait
        # for their result: a chained plan makes the worker finish the step before it (it needs
        # the accepted counts), which costs every other sequence in the batch its overlap.
        chain = self.config.chain_verifications and self._most_await()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            chained = self._chained_drafts(req, budget) if req.awaiting_result and chain else None
            if (req.awaiting_result and chained is None) or self._needs_no_more(req):
                # Its next position depends on a result in flight (drafts), or its last token
                # is in flight: it finishes when that result is applied.
                i += 1
                continue
            num_tokens = req.num_tokens
            if req.awaiting_result:
                # Chained behind the verification in flight: one more token after whatever it
                # accepts, plus the drafts the worker proposes then (it resolves the positions).
                drafts = int(chained)
                num_new = 1 + drafts
                self.spec.stats.num_chained += 1
            else:
                num_new = min(num_tokens + req.num_pending - req.num_computed_tokens, budget, chunk)
                drafts = 0
                if req.num_drafts and num_new == 1 and req.num_pending <= 1:
                    drafts = self.spec.drafts_to_verify(req, budget, cfg.max_model_len)
                    num_new += drafts
            root = req.cache_root
            new_blocks = self.blocks.allocate(
                req.request_id, tokens_of(req), req.num_computed_tokens, num_new, num_tokens, root
            )
            while new_blocks is None:
                victim = self._pick_victim(self.running[i:])
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                new_blocks = self.blocks.allocate(
                    req.request_id, tokens_of(req), req.num_computed_tokens, num_new, num_tokens, root
                )
            if new_blocks is None:
                continue  # req itself was preempted; running[i] is now the next one
            self._add_to_plan(plan, req, num_new, new_blocks, drafts, chained=req.awaiting_result)
            budget -= num_new
            i += 1

        # New admissions only when nothing was preempted, so a freed block is not fought over.
        # Fair between callers: a request (group of n choices) that already runs its share of the
        # batch waits while another caller's request is admitted, so one request of 1,000
        # sequences cannot hold everyone else back for its whole length.
        # When every waiting request's caller is at its share, admit in order (no idle slots).
        share = max(1, cfg.max_num_seqs // max(1, len(self._groups)))
        w, in_order = 0, False
        tiers = self.tiers if self.tiers.enabled else None
        while not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            if not in_order:
                # Counts only grow while admitting, so the scan resumes where it stopped.
                while w < len(self.waiting) and (
                    self._group_running[self.waiting[w].group] >= share or self.waiting[w].kv_lookup_pending
                ):
                    w += 1
                if w == len(self.waiting):
                    w, in_order = 0, True
            if in_order:
                # Requests whose store lookup is still out wait for its answer (a few ms at most).
                while w < len(self.waiting) and self.waiting[w].kv_lookup_pending:
                    w += 1
                if w == len(self.waiting):
                    break
            req = self.waiting[w]
            if req.lora_name and not self.loras.fits(req, self.running):
                w += 1  # its adapter would be one more than the worker's slots: it waits
                continue
            tokens = req.all_token_ids
            bs = self.blocks.block_size
            # One key chain serves the GPU cache and the tiers below it.
            root = req.cache_root
            keys = None if tiers is None else extend_block_keys([], tokens, bs, self.blocks.fingerprint, root)
            hits = self.blocks.longest_cached_prefix(tokens, keys, root)
            # Always compute at least the last token: its logits give the next token. A request
            # that wants prompt logprobs computes its whole prompt (vLLM too): no hit at all.
            max_blocks = 0 if req.computes_whole_prompt else (len(tokens) - 1) // bs
            num_gpu = min(len(hits), max_blocks)
            # Past the GPU hit, the worker's host tier and then the KV store may hold more blocks:
            # they are loaded into fresh blocks by this plan instead of being computed.
            # A direct handover's prompt is copied whole from its prefill worker (the decode
            # worker computes its first token only): the tiers are not looked at.
            peer = usable_peer(req, bs, len(tokens))
            tiers_now = tiers if peer is None else None
            tier_hit = tiers_now.find(req, keys, num_gpu, max_blocks) if tiers_now is not None else None  # type: ignore[arg-type]
            num_computed = (num_gpu + (tier_hit.num_blocks(num_gpu) if tier_hit else 0)) * bs
            if peer is not None:
                num_computed = peer.num_tokens
            num_new = min(len(tokens) - num_computed, budget, chunk)
            if not cfg.enable_chunked_prefill and num_new < len(tokens) - num_computed:
                break
            new_blocks = self.blocks.allocate(
                req.request_id, tokens, num_gpu * bs, num_computed - num_gpu * bs + num_new, root=root
            )
            if new_blocks is None:
                break
            self.waiting.pop(w)
            self._group_running[req.group] += 1
            if tier_hit is not None:
                tiers.admit(req, self.blocks.block_ids(req.request_id), num_gpu, tier_hit)  # type: ignore[union-attr]
            if peer is not None:
                ids = self.blocks.block_ids(req.request_id)
                self._peer_copies.append(peer_copy(req, peer, ids, num_gpu, bs))
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
                self.blocks.record_lookup(len(tokens), num_computed)
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_to_plan(plan, req, num_new, new_blocks)
            budget -= num_new

        plan.finished_ids, self._to_drop = self._to_drop, []
        plan.preempted_ids, self._to_preempt = self._to_preempt, []
        if not self._sampling:
            del self._sampling_by_step[plan.step_id]
        if not self._spec:
            del self._spec_by_step[plan.step_id]
        keyed = self.blocks.take_newly_keyed()
        if keyed:
            self._keyed_by_step[plan.step_id] = keyed
        if self.tiers.enabled:
            plan.kv = self.tiers.finish_plan(plan.step_id, keyed, plan.num_seqs > 0)
        if self._peer_copies:
            plan.kv.peer_copies, self._peer_copies = self._peer_copies, []
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestDelta]:
        """Apply a plan's result (in plan order): append sampled tokens, finish what must stop."""
        self._keyed_by_step.pop(plan.step_id, None)  # its KV is written: the keys are real
        self.tiers.executed(plan.step_id, result.failed_load_seq_ids, result.kv_verify_failures)
        sampled = self._sampling_by_step.pop(plan.step_id, {})
        speculating = self._spec_by_step.pop(plan.step_id, {})
        for seq_id, incarnation in sampled.items():
            req = self.requests.get(seq_id)
            if req is not None and req.incarnation == incarnation:
                req.num_pending -= 1
        for chunk in result.prompt_logprobs:  # first: a request its first token finishes is gone after
            self._absorb_prompt_logprobs(chunk)
        # Tokens gained per sequence, in order of first appearance (a verification gains several).
        # Runs once per sampled sequence per step: kept to plain dict and list operations.
        gained: dict[str, int] = {}
        touched: list[Request] = []
        requests, running = self.requests, RequestStatus.RUNNING
        for seq_id, token_id, logprobs in zip(result.seq_ids, result.token_ids, result.logprobs, strict=True):
            req = requests.get(seq_id)
            if req is None or req.status is not running:
                continue  # aborted or finished while the step was in flight
            if sampled.get(seq_id) != req.incarnation:
                continue  # preempted (and perhaps re-admitted) since this plan was made
            req.output_token_ids.append(token_id)
            req.output_logprobs.append(logprobs)
            if seq_id in gained:
                gained[seq_id] += 1
            else:
                gained[seq_id] = 1
                touched.append(req)
            reason = self._stop_reason(req, token_id)
            if reason is not None:
                self._finish(req, reason)
        if speculating:
            self._apply_speculation(speculating, sampled, result, gained)
        deltas = [self.delta(req, gained[req.request_id]) for req in touched]
        for out in result.pooled:  # pooling requests end with their vector, no token
            req = self.requests.get(out.seq_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            if sampled.get(out.seq_id) != req.incarnation:
                continue  # restarted (preempted) since this plan was made: it is pooled again
            req.embedding = out.values
            self._finish(req, FinishReason.STOP)
            deltas.append(self.delta(req, 0))
        return deltas

    def _apply_speculation(
        self,
        speculating: dict[str, tuple[int, int]],
        sampled: dict[str, int],
        result: StepResult,
        gained: dict[str, int],
    ) -> None:
        """Drafts verified and proposed by a plan: computed lengths, the worker's drafts, the policy."""
        proposed = dict(zip(result.draft_seq_ids, result.num_draft_tokens, strict=True))
        for seq_id, entry in speculating.items():
            req = self.requests.get(seq_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished or aborted meanwhile
            if sampled.get(seq_id) != req.incarnation:
                continue  # restarted (preempted) since this plan was made
            later = self._spec_in_flight(seq_id)  # this plan's entry is popped: the ones after it
            if entry.holds:  # this plan held it back: only plans chained behind it are in flight
                req.awaiting_result = any(e.holds for e in later.values())
                # The KV of every token but the newest is written (rejected drafts' slots lie past
                # it), and the chained plans compute from the newest on.
                req.num_computed_tokens = req.num_tokens - 1 + sum(e.num_new for e in later.values())
            if entry.proposed:
                accepted = gained.get(seq_id, 0) - 1
                self.spec.verified(req, entry.proposed, min(accepted, entry.proposed))
            if entry.propose:
                num_proposed = proposed.get(seq_id, 0)
                self.spec.proposed(req, num_proposed)
                if later:  # the plan chained behind this one verifies this proposal
                    first = min(later)
                    e = later[first]
                    self._spec_by_step[first][seq_id] = e._replace(proposed=min(e.drafts, num_proposed))

    def _absorb_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """File a chunk of prompt logprobs; a recomputed position keeps its first answer."""
        req = self.requests.get(chunk.seq_id)
        if req is None or req.prompt_logprobs is None or req.prompt_logprobs_sent:
            return
        held, prompt = req.prompt_logprobs, req.prompt_token_ids
        for pos, entry in enumerate(chunk.entries, start=chunk.first):
            # Only answers for this prompt's own tokens are filed (a confused worker's are dropped).
            if 0 < pos < len(held) and held[pos] is None and entry.token_id == prompt[pos]:
                held[pos] = entry

    def delta(self, req: Request, num_new: int) -> RequestDelta:
        prompt_logprobs = None
        if num_new and req.needs_prompt_logprobs:  # with the first token: the prompt is done
            prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        out, logprobs = req.output_token_ids, req.output_logprobs
        n_out = len(out)
        # Positional: one of these per sampled sequence per step.
        return RequestDelta(
            req.request_id,
            out[n_out - num_new :],
            logprobs[len(logprobs) - num_new :],
            req.finish_reason,
            len(req.prompt_token_ids),
            n_out,
            req.num_cached_tokens if req.num_cached_tokens > 0 else 0,
            prompt_logprobs,
            req.embedding,
        )

    # ----- the worker's link broke -----
    def resync(self, last_executed_step_id: int | None) -> None:
        """The worker reconnected holding no sequences: plan from scratch, keep what survived.

        `last_executed_step_id` is the worker's answer after a reconnect to the
        same process (its KV cache survived): keys registered by plans after it
        name blocks never written and are forgotten. None means a new process:
        every cached key is forgotten. Running requests are preempted (their
        full blocks stay cached, so recomputing them is mostly prefix hits);
        waiting requests keep their place.
        """
        for req in list(reversed(self.running)):
            self._release(req, [])
            req.status = RequestStatus.PREEMPTED
            req.restart()
            self._enqueue(req, front=True)
        for step_id, keyed in sorted(self._keyed_by_step.items()):
            if last_executed_step_id is None or step_id > last_executed_step_id:
                self.blocks.forget_keys(keyed)
        self._keyed_by_step.clear()
        self._sampling_by_step.clear()
        self._spec_by_step.clear()
        self.tiers.resync(last_executed_step_id)
        if last_executed_step_id is None:
            self.blocks.reset_prefix_cache()
        self._on_worker.clear()
        self._to_drop.clear()
        self._to_preempt.clear()

    def take_all(self) -> list[Request]:
        """Remove every unfinished request (in arrival order), freeing its blocks: they move elsewhere."""
        taken = sorted(self.requests.values(), key=lambda r: r.arrival_time)
        for req in taken:
            self._release(req, [])
        for req in taken:
            req.restart()
        self.requests.clear()
        self.waiting.clear()
        self._sampling_by_step.clear()
        self._spec_by_step.clear()
        self._keyed_by_step.clear()
        self._groups.clear()
        self._group_running.clear()
        self._on_worker.clear()
        self._to_drop.clear()
        self._to_preempt.clear()
        return taken

    # ----- internals -----
    def _needs_no_more(self, req: Request) -> bool:
        """Every token it may still produce is already being sampled by plans in flight."""
        if not req.num_pending:
            return False
        if req.is_pooling:  # its last chunk is in flight: the vector is all that comes
            return True
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None and len(req.output_token_ids) + req.num_pending >= max_tokens:
            return True
        return req.num_tokens + req.num_pending >= self.config.max_model_len

    def _spec_in_flight(self, seq_id: str) -> dict[int, SpecEntry]:
        """{step id: entry} of the plans in flight that speculate for `seq_id` (two at most)."""
        return {
            step_id: e for step_id, step in self._spec_by_step.items() if (e := step.get(seq_id)) is not None
        }

    def _chained_drafts(self, req: Request, budget: int) -> int | None:
        """Drafts a plan may verify for `req` behind the verification in flight (None: it waits).

        Only with drafts made ahead (n-gram: the worker proposes from the tokens it accepted,
        before this plan reaches it), and only while it still speculates. Room is counted as if
        every draft in flight were accepted: a plan never schedules past max_tokens or the
        context, whatever the verification in flight gives.
        """
        if not self.spec.drafts_ahead or req.spec_skip > 0:
            return None
        inflight = self._spec_in_flight(req.request_id).values()
        if not any(e.holds for e in inflight):
            return None
        most = req.num_tokens + req.num_pending + sum(e.drafts for e in inflight)
        room = self.config.max_model_len - most
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - (most - len(req.prompt_token_ids)))
        if room < 1:
            return None  # its last token may be in flight: that result decides
        return max(0, min(self.spec.k, room - 1, budget - 1))

    def _add_to_plan(
        self,
        plan: StepPlan,
        req: Request,
        num_new: int,
        new_blocks: list[int],
        drafts: int = 0,
        chained: bool = False,
    ) -> None:
        # Counted as computed now, so that the next plan can follow before this result is back.
        start = req.num_computed_tokens
        req.num_computed_tokens += num_new
        req.num_drafts = 0  # the worker's drafts are used now or never (it samples a new token)
        propose = 0
        if req.num_computed_tokens >= req.num_tokens + req.num_pending:  # drafts go past the end
            req.num_pending += 1  # the worker samples the next token and keeps it
            self._sampling[req.request_id] = req.incarnation
            if self.spec.enabled and not req.is_pooling:
                # Waiting requests count: a burst being admitted is a big batch from its first plan.
                batch = len(self.running) + len(self.waiting)
                propose = self.spec.drafts_to_propose(req, self.config.max_model_len, batch)
            if drafts or propose or chained:
                # Its next position depends on a verification's result; a proposal's, unless
                # the worker proposes ahead (then a later plan verifies the drafts a token late).
                holds = bool(drafts) or chained or not self.spec.drafts_ahead
                req.awaiting_result = req.awaiting_result or holds
                proposal = 0 if chained else drafts  # a chained plan's: once its proposal is reported
                self._spec[req.request_id] = SpecEntry(drafts, propose, num_new, holds, proposal)
        if req.request_id in self._on_worker:
            plan.scheduled.append(ScheduledSequence(req.request_id, num_new, new_blocks, propose))
            return
        self._on_worker.add(req.request_id)
        plan.new_seqs.append(
            NewSequence(
                seq_id=req.request_id,
                token_ids=req.all_token_ids,
                num_prompt_tokens=len(req.prompt_token_ids),
                block_ids=list(self.blocks.block_ids(req.request_id)),
                num_computed_tokens=start,
                num_new_tokens=num_new,
                sampling_params=req.sampling_params,
                max_draft_tokens=propose,
                lora_name=req.lora_name,
                lora_path=req.lora_path,
            )
        )
        self.loras.touch(req)

    def _stop_reason(self, req: Request, token_id: int) -> FinishReason | None:
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens:
            if token_id in sp.stop_token_ids:
                req.stop_token_id = token_id
                return FinishReason.STOP
            if not sp.ignore_eos and token_id in req.eos_token_ids:
                return FinishReason.STOP
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _release(self, req: Request, tell_worker: list[str]) -> None:
        """Take a request off the running list, free its blocks, queue a drop for the worker."""
        if req in self.running:
            self.running.remove(req)
            self._group_running[req.group] -= 1
            if self._group_running[req.group] <= 0:
                del self._group_running[req.group]
        self.blocks.free_seq(req.request_id)
        if req.request_id in self._on_worker:
            self._on_worker.discard(req.request_id)
            tell_worker.append(req.request_id)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.hold_blocks and reason is FinishReason.LENGTH:
            self.blocks.hold(req.request_id)  # a decode worker copies them (disaggregation.py)
        self._release(req, self._to_drop)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self._groups[req.group] -= 1
        if self._groups[req.group] <= 0:
            del self._groups[req.group]

    def _pick_victim(self, candidates: list[Request]) -> Request:
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self._release(req, self._to_preempt)
        req.status = RequestStatus.PREEMPTED
        req.restart()
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)

    def _enqueue(self, req: Request, front: bool) -> None:
        if req.status is not RequestStatus.PREEMPTED:
            req.status = RequestStatus.WAITING
        if self.config.policy == "priority":
            keys = [(r.priority, r.arrival_time) for r in self.waiting]
            self.waiting.insert(bisect.bisect_right(keys, (req.priority, req.arrival_time)), req)
        elif front:
            self.waiting.insert(0, req)
        else:
            self.waiting.append(req)
