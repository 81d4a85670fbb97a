"""Speculative decoding, the scheduler's half: when to ask a worker for drafts, and what they gave.

The worker proposes draft tokens after it samples (`max_draft_tokens` on the plan); a later
plan schedules them as extra tokens of the sequence and the worker verifies them in one
forward. A sequence's next position depends on how many of its drafts are accepted. With n-gram
proposals (`drafts_ahead`: the worker proposes from the tokens it has, without waiting for the
scheduler) the next plan chains another verification behind the one in flight, as if every
draft were accepted for the room it reserves; the worker applies the first result before it
starts the next plan, so it knows the real positions and verifies the drafts it has just
proposed. Nothing waits on the round trip to the scheduler. A draft model's proposal, and a
sequence backing off, wait for the result instead.

Adaptive, per sequence: a verification that accepts nothing (or a draft model's proposal that
found nothing: it was waited for) quadruples how many steps the sequence then decodes without
speculating (1, 4, 16, 64, then `MAX_BACKOFF_STEPS`); an accepted draft resets it. An n-gram
lookup that finds nothing cost nobody a wait, only the worker's lookup (tens of microseconds):
the sequence looks again after `EMPTY_LOOKUP_SKIP` steps, never later, so an answer that starts
copying its prompt mid-way is caught at once. (Escalating there too left most of a copying
answer unspeculated: its first, uncopied tokens pushed the next lookup 85 steps out.) Random text
thus runs as plain, overlapped decoding, while text that copies its prompt speculates nearly
every step; batches above `disable_by_batch_size` do not speculate at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.request import Request

MAX_BACKOFF_STEPS = 128
# Plain steps between two n-gram lookups after one that found nothing.
EMPTY_LOOKUP_SKIP = 1


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: verifications with drafts, drafts, accepted drafts (per position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # Verifications planned behind one still in flight (not one of vLLM's counters).
    num_chained: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens gained per verification (the accepted drafts plus the sampled one), as vLLM."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecodePolicy:
    def __init__(
        self, num_speculative_tokens: int, disable_by_batch_size: int = 0, drafts_ahead: bool = False
    ) -> None:
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        # The worker proposes without the last token on the host (WorkerInfo.spec_drafts_ahead).
        self.drafts_ahead = drafts_ahead
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * num_speculative_tokens)

    @property
    def enabled(self) -> bool:
        return self.k > 0

    def drafts_to_propose(self, req: Request, max_model_len: int, num_running: int = 1) -> int:
        """How many drafts to ask for after the token this plan samples for `req` (0 = none).

        Called once the plan counts that token as pending. Drafts past max_tokens or the
        context could never be used: the token sampled after them needs room too.
        """
        sp = req.sampling_params
        if self.disable_by_batch_size and num_running > self.disable_by_batch_size:
            return 0  # a big batch pays more for waiting on results than drafts save
        if not self.k or sp.logprobs is not None or sp.structured_outputs is not None:
            # Logprobs are per sampled position; a grammar's matcher advances one token at a time.
            return 0
        if req.spec_skip > 0:
            req.spec_skip -= 1
            return 0
        produced = len(req.output_token_ids) + req.num_pending
        room = max_model_len - (req.num_tokens + req.num_pending)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - produced)
        return max(0, min(self.k, room - 1))

    def drafts_to_verify(self, req: Request, budget: int, max_model_len: int) -> int:
        """How many of the drafts the worker holds for `req` the next plan verifies.

        Drafts proposed before a token now in flight start one position early: the first is
        skipped (the worker does the same from its own count).
        """
        n = min(req.num_drafts - (req.num_tokens + req.num_pending - req.draft_base), budget - 1)
        produced = len(req.output_token_ids) + req.num_pending
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            n = min(n, max_tokens - produced - 1)
        return max(0, min(n, max_model_len - req.num_tokens - req.num_pending - 1))

    def proposed(self, req: Request, num_drafts: int) -> None:
        req.num_drafts = num_drafts
        req.draft_base = req.num_tokens
        if not num_drafts:
            if self.drafts_ahead:
                # An n-gram lookup found nothing; nothing waited for it. Look again soon.
                req.spec_skip = EMPTY_LOOKUP_SKIP
            else:
                self._back_off(req)  # a draft model's proposal was waited for in vain

    def verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            s.accepted_per_pos[pos] += 1
        if num_accepted:
            req.spec_failures = 0
        else:
            self._back_off(req)

    @staticmethod
    def _back_off(req: Request) -> None:
        req.spec_skip = min(4**req.spec_failures, MAX_BACKOFF_STEPS)
        req.spec_failures += 1
