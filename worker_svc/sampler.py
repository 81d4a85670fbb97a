"""Batched token sampling: logits [B, V] -> one token id (and optional logprobs) per row.

Torch ops, so the same code runs on CPU and CUDA, but for two passes that take a Triton
kernel on CUDA (each beside its torch twin): the token bitmask and the rows' argmax. The
whole step costs exactly one device->host copy: every result (sampled ids, and the logprob
tensors when some row asked for them) is packed into one int32 tensor and copied once.
Everything the host needs to decide (which stages run, which rows are greedy, how many top
logprobs) comes from the Python-side SamplingParams, never from device values, so no stage
syncs on its own. Host->device copies of per-row parameters are issued non-blocking.

Order of operations (as vLLM v1):
  1. logprobs from the raw logits (log_softmax before any processing), then the
     structured-outputs token bitmask (disallowed tokens -> -inf) when a row has one;
  2. min_tokens: EOS ids (unless ignore_eos) and stop_token_ids -> -inf while the
     sequence has fewer than min_tokens output tokens;
  3. repetition_penalty (HF style, over prompt + output tokens);
  4. presence / frequency penalties (OpenAI style, over output tokens, with counts);
  5. greedy rows (temperature == 0) take the argmax;
  6. other rows: / temperature, top_k, top_p, min_p, then an exponential race
     (argmax(probs / Exp(1) noise)), which samples from the filtered distribution
     with one noise tensor per row whatever filters ran.

Seeded rows draw their noise from a generator seeded by a hash of (seed, number of
tokens generated so far), so the k-th token of a seeded request is drawn the same
way whatever else shares the batch, at any row position, after preemption and
recompute, and in another process (on the same kind of device: CPU and CUDA
generators produce different streams).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from services.sampling_params import SamplingParams
from services.step import TokenLogprobs
from worker_svc.pinned_slots import PinnedSlots, Slot

_NEG_INF = float("-inf")
_MASK63 = (1 << 63) - 1
# Results up to this size reach the host through a kernel's stores (`_to_host_async`).
_KERNEL_COPY_MAX_BYTES = 1 << 20


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence of the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far for this sequence
    eos_token_ids: list[int]  # model's EOS ids (masked until min_tokens reached unless ignore_eos)
    # Greedy, and no logit processor can ever touch it (`_never_processed_greedy`): read once a
    # row per step by the greedy fast path, which a 1,000-row batch otherwise spends ~1 ms on.
    plain_greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        self.plain_greedy = _never_processed_greedy(self.params)


def seeded_draw_seed(seed: int, num_output_tokens: int) -> int:
    """Generator seed for the draw of token number `num_output_tokens` of a seeded request.

    A hash rather than e.g. `seed + step` so that neighbouring seeds do not share
    shifted noise streams; sha256 because Python's hash() is salted per process.
    """
    data = seed.to_bytes(8, "little", signed=True) + num_output_tokens.to_bytes(8, "little")
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & _MASK63


@dataclass
class SampledIds:
    """One step's sampled ids: on the device at once, on the host after `wait()`."""

    sampled: torch.Tensor  # int32 [rows] on the device
    _host: torch.Tensor  # packed int32 results on the host, complete once `_done` fires
    _done: torch.cuda.Event | None
    _logprobs: list[int | None]  # each row's requested number of top logprobs
    _lp_rows: list[int]
    _k_max: int
    # Verification only (`Sampler.verify_async`): draft tokens each row accepted before its id.
    _num_accepted: list[int] | None = None
    _slot: Slot | None = None  # the page-locked buffer under `_host`, lent until this is dropped

    @classmethod
    def empty(cls, device: torch.device) -> SampledIds:
        none = torch.empty(0, dtype=torch.int32)
        return cls(none.to(device), none, None, [], [], 0)

    @property
    def done_event(self) -> torch.cuda.Event | None:
        """Fires once the ids are on the host (`wait()` then blocks no more); None: they are already."""
        return self._done

    @property
    def num_accepted(self) -> list[int] | None:
        """After `wait()`, for a verification: how many of its drafts each row accepted."""
        return self._num_accepted

    def wait(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        if self._done is not None:
            self._done.synchronize()
        host = self._host
        num_rows = len(self._logprobs)
        ids = host[:num_rows].tolist()
        if self._num_accepted is not None:  # packed last: [ids | logprobs ... | accepted]
            self._num_accepted = host[len(host) - num_rows :].tolist()
        out: list[TokenLogprobs | None] = [None] * num_rows
        n_lp, k_max = len(self._lp_rows), self._k_max
        if not n_lp:
            return ids, out
        off = num_rows
        tok_lps = host[off : off + n_lp].view(torch.float32).tolist()
        off += n_lp
        ranks = host[off : off + n_lp].tolist()
        off += n_lp
        if k_max > 0:
            top_ids_h = host[off : off + n_lp * k_max].view(n_lp, k_max).tolist()
            off += n_lp * k_max
            top_lps_h = host[off : off + n_lp * k_max].view(torch.float32).view(n_lp, k_max).tolist()
        for j, i in enumerate(self._lp_rows):
            k = self._logprobs[i] or 0
            out[i] = TokenLogprobs(
                token_id=ids[i],
                logprob=tok_lps[j],
                rank=ranks[j],
                top_token_ids=top_ids_h[j][:k] if k else [],
                top_logprobs=top_lps_h[j][:k] if k else [],
            )
        return ids, out


def _to_host_async(
    t: torch.Tensor, slots: PinnedSlots | None
) -> tuple[torch.Tensor, torch.cuda.Event | None, Slot | None]:
    """(host copy of an int32 tensor [n], the event that marks it complete, the page-locked slot
    holding it; event and slot None when already there).

    Queued behind the step's kernels; the host waits for it only in `SampledIds.wait`, not here.
    Up to `_KERNEL_COPY_MAX_BYTES` a kernel stores it into a page-locked slot (a few us of the
    stream, where the copy engine's start held it ~10 us on an H100); beyond, the copy engine.
    """
    if not t.is_cuda:
        return t, None, None
    nbytes = t.numel() * 4
    if slots is None or nbytes > _KERNEL_COPY_MAX_BYTES:
        host = torch.empty(t.shape, dtype=torch.int32, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done, None
    from kernels.triton.pinned_io import copy_to_host

    slot = slots.take(nbytes)
    host = slot.buffer[:nbytes].view(torch.int32)
    copy_to_host(t, host)
    return host, slot.record(), slot


@dataclass
class GreedyVerification(SampledIds):
    """A verification whose rows are all greedy: the argmax of every row is copied to the host
    and the drafts are checked there (a handful of integers), which saves the device-side
    bookkeeping of `Sampler.verify_async`'s general path (a dozen small kernels and uploads)."""

    _drafts: list[list[int]] | None = None
    _starts: list[int] | None = None

    def wait(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        if self._done is not None:
            self._done.synchronize()
        top = self._host.tolist()
        assert self._drafts is not None and self._starts is not None
        ids, accepted = [], []
        for drafts, start in zip(self._drafts, self._starts, strict=True):
            a = 0
            while a < len(drafts) and drafts[a] == top[start + a]:
                a += 1
            accepted.append(a)
            ids.append(top[start + a])
        self._num_accepted = accepted
        return ids, [None] * len(ids)


def rows_argmax(x: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[rows] of `dtype` (int64 or int32): each row's first maximal column. On CUDA split over
    the row (kernels/triton/argmax.py): torch reduces a row in one block of threads, 37 us for
    one 128k row on an H100, a tenth of a batch-1 step's time above its floor."""
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:
        from kernels.triton.argmax import argmax_rows

        return argmax_rows(x, dtype)
    return x.argmax(dim=-1).to(dtype)


def uses_penalties(p: SamplingParams) -> bool:
    """A repetition, presence or frequency penalty: processors that read the tokens so far."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


# Which rows each logit processor (stages 2-4) touches.
def _never_processed_greedy(p: SamplingParams) -> bool:
    """Greedy, and each predicate below False at every output length: no min_tokens, no
    penalty."""
    return p.greedy and p.min_tokens == 0 and not uses_penalties(p)


def _min_tokens_pending(r: SamplingRow) -> bool:
    return len(r.output_token_ids) < r.params.min_tokens


def _repetition_penalised(r: SamplingRow) -> bool:
    return r.params.repetition_penalty != 1.0


def _count_penalised(r: SamplingRow) -> bool:
    """Presence / frequency penalties: counts of output tokens, none before the first."""
    p = r.params
    return (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and bool(r.output_token_ids)


class Sampler:
    # Above this k, sorting the vocabulary once beats torch.topk.
    TOPK_PATH_MAX_K = 1024
    NUCLEUS_SEARCH_MIN_ROWS = 16  # `_searches_nucleus`
    NUCLEUS_SEARCH_ON_CPU = False  # tests: the search under Triton's interpreter

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # Unseeded rows share this generator; seeded rows reseed `_seeded_gen` per draw.
        self._gen = torch.Generator(device=self.device)
        if seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(seed & _MASK63)
        self._seeded_gen = torch.Generator(device=self.device)
        # The unseeded rows' noise seeds on CUDA (`_race_seeds`).
        self._host_rng = np.random.default_rng(None if seed is None else seed & _MASK63)
        self._arange_v = torch.arange(vocab_size, device=self.device)
        # Each step's results on their way to the host (`_to_host_async`).
        self._slots = PinnedSlots() if self.device.type == "cuda" else None

    # -- helpers --------------------------------------------------------------

    def _to_dev(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return self._upload(torch.tensor(values, dtype=dtype))

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        # non_blocking: a blocking H2D copy synchronizes the stream. From pageable memory the
        # driver stages the bytes before returning, so `host` may be freed at once. Measured on
        # an H100: returns in ~7 us without waiting for queued kernels; pin_memory() first
        # costs ~14 us per copy and buys nothing at these sizes.
        return host.to(self.device, non_blocking=True)

    def _private_copy(self, logits: torch.Tensor) -> torch.Tensor:
        # Padded lm_head columns (logits wider than the vocab) are never sampled. One
        # private contiguous float32 copy lets the processors work in place without
        # touching the caller's tensor.
        fmt = torch.contiguous_format
        return logits[:, : self.vocab_size].to(torch.float32, copy=True, memory_format=fmt)

    def _flat_token_index(self, seqs: list[list[int]]) -> torch.Tensor:
        """Device int64 indices `row * vocab + token` of every token of every seq, for
        index_fill_/index_add_ into a flattened [R, V] tensor.

        Built with numpy from one chained iterator: per-token Python work is what makes
        penalties slow for long sequences (ids outside the vocab are dropped, not trusted).
        """
        vocab = self.vocab_size
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        toks = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
        row_of = np.repeat(np.arange(len(seqs), dtype=np.int64), lengths)
        ok = (toks >= 0) & (toks < vocab)
        flat = row_of[ok] * vocab + toks[ok]
        return self._upload(torch.from_numpy(flat))

    def _rows(self, t: torch.Tensor, sel: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(index tensor, or None when `sel` is every row; the selected rows of t).

        `sel` is ascending, so covering every row means it is exactly range(len(t)).
        """
        if len(sel) == t.shape[0]:
            return None, t
        idx = self._to_dev(sel, torch.int64)
        return idx, t[idx]

    # -- the step -------------------------------------------------------------

    def sample_async(
        self, logits: torch.Tensor, rows: list[SamplingRow], token_bitmask: torch.Tensor | None = None
    ) -> SampledIds:
        """Queue the sampling of each row; the ids stay on the device until `wait()` reads them.

        The next step may take its input ids from `SampledIds.sampled` before they are read, so
        the host never waits on the device between two steps. `token_bitmask` (host int32
        [rows, ceil(vocab / 32)], bit t of a row set = token t allowed) constrains rows to
        their grammars; free rows are all ones.
        """
        num_rows = len(rows)
        if num_rows == 0:
            return SampledIds.empty(self.device)
        if logits.dim() != 2 or logits.shape[0] != num_rows or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {num_rows} rows x {self.vocab_size}")
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        logits, raw_logprobs = self._prepare(logits, rows, lp_rows, token_bitmask)

        greedy_rows = [i for i, r in enumerate(rows) if r.params.greedy]
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            sampled = rows_argmax(logits, torch.int32)  # what the results and a patch carry
        elif not greedy_rows:
            sampled = self._sample_random(logits, rows)
        else:
            sampled = torch.empty(num_rows, dtype=torch.int64, device=self.device)
            g_idx = self._to_dev(greedy_rows, torch.int64)
            r_idx = self._to_dev(random_rows, torch.int64)
            sampled[g_idx] = rows_argmax(logits[g_idx])
            sampled[r_idx] = self._sample_random(logits[r_idx], [rows[i] for i in random_rows])

        return self._gather_results(sampled, raw_logprobs, rows, lp_rows)

    def verify_async(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        drafts: list[list[int]],
        token_bitmask: torch.Tensor | None = None,
    ) -> SampledIds:
        """Speculative decoding: accept or reject each sequence's draft tokens; queue the results.

        Sequence i owns `len(drafts[i]) + 1` consecutive logits rows (and `rows` entries, each
        with the output so far up to that position, so penalties, min_tokens and seeds see
        exactly what one-token-at-a-time decoding would). Its result row is the token that
        follows its accepted drafts, and `num_accepted` counts them.

        Drafts are deterministic proposals (n-gram lookup, a greedy draft model), i.e. a
        one-hot draft distribution q, so the standard rule (accept d with min(1, p(d)/q(d)),
        else sample from max(p - q, 0) renormalised) becomes: accept d with probability p(d),
        else sample from p without d; after every draft is accepted, sample from p once more.
        Each output token is then distributed exactly as the target model samples it; greedy
        rows accept d iff it is the argmax. Still one device->host copy. `token_bitmask`: as in
        `sample_async`, one row per logits row (structured outputs; such rows draft nothing).
        """
        num_seqs = len(drafts)
        counts = [len(d) for d in drafts]
        num_rows = sum(counts) + num_seqs
        if logits.dim() != 2 or logits.shape[0] != num_rows or len(rows) != num_rows:
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match {num_rows} rows of {num_seqs} sequences"
            )
        ends = np.cumsum(np.asarray(counts, dtype=np.int64) + 1)
        starts = ends - np.asarray(counts, dtype=np.int64) - 1
        last_rows = [rows[int(e) - 1] for e in ends]  # a sequence's params, and its logprobs request
        lp_seqs = [i for i, r in enumerate(last_rows) if r.params.logprobs is not None]
        if any(counts[i] for i in lp_seqs):
            raise ValueError("a sequence that asks for logprobs cannot verify drafts")
        logits, raw_logprobs = self._prepare(logits, rows, [int(ends[i]) - 1 for i in lp_seqs], token_bitmask)
        if not lp_seqs and all(r.params.greedy for r in rows):
            return self._verify_greedy(logits, drafts, starts, ends)

        # Per row: the draft it checks (-1 on a sequence's last row) and the candidate token
        # (the argmax / a sample from p without the draft / on the last row, a sample from p).
        draft_of_row = np.full(num_rows, -1, dtype=np.int64)
        for i, d in enumerate(drafts):
            draft_of_row[starts[i] : starts[i] + len(d)] = d
        d_draft = self._upload(torch.from_numpy(draft_of_row))
        cand = torch.empty(num_rows, dtype=torch.int64, device=self.device)
        accept = torch.zeros(num_rows, dtype=torch.bool, device=self.device)
        greedy = [j for j, r in enumerate(rows) if r.params.greedy]
        random = [j for j, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            g_idx, g_logits = self._rows(logits, greedy)
            top = rows_argmax(g_logits)
            ok = top == (d_draft if g_idx is None else d_draft[g_idx])
            if g_idx is None:
                cand, accept = top, ok
            else:
                cand[g_idx], accept[g_idx] = top, ok
        if random:
            r_idx, r_logits = self._rows(logits, random)
            r_rows = [rows[j] for j in random]
            probs = self.filtered_probs(r_logits, r_rows)
            r_draft = d_draft if r_idx is None else d_draft[r_idx]
            has_draft = r_draft >= 0
            safe = r_draft.clamp_min(0)[:, None]
            p_draft = probs.gather(1, safe)[:, 0]
            ok = has_draft & (self._uniform(r_rows) < p_draft)
            # Without the draft (no renormalising needed: the exponential race is scale-free).
            probs = probs.scatter(1, safe, torch.where(has_draft[:, None], 0.0, p_draft[:, None]))
            pick = rows_argmax(probs / self._exponential_noise(r_rows))
            if r_idx is None:
                cand, accept = pick, ok
            else:
                cand[r_idx], accept[r_idx] = pick, ok

        # Accepted drafts per sequence: the leading run of accepts, read through a padded
        # [seqs, longest + 1] view of the rows (padding points at the sequence's last row,
        # which never accepts).
        width = max(counts) + 1
        grid = np.minimum(starts[:, None] + np.arange(width)[None, :], (ends - 1)[:, None])
        d_grid = self._upload(torch.from_numpy(grid))
        num_accepted = accept[d_grid].to(torch.int32).cumprod(dim=1).sum(dim=1)
        d_starts = self._upload(torch.from_numpy(starts))
        sampled = cand[d_starts + num_accepted]
        return self._gather_results(sampled, raw_logprobs, last_rows, lp_seqs, num_accepted)

    # -- structured outputs ---------------------------------------------------

    def _apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Disallowed tokens -> -inf, in place: one upload of the packed mask, then one Triton
        pass on CUDA (kernels/triton/token_bitmask.py), its torch twin elsewhere."""
        if bitmask.shape[0] != logits.shape[0] or bitmask.shape[1] * 32 < self.vocab_size:
            raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}")
        words = self._upload(bitmask)
        if logits.is_cuda:
            from kernels.triton.token_bitmask import apply_token_bitmask_
        else:
            from kernels.reference import apply_token_bitmask_
        apply_token_bitmask_(logits, words)

    def _prepare(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        lp_rows: list[int],
        token_bitmask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(processed private copy of the logits, raw logprobs [L, V] of rows `lp_rows` or None).

        The logprobs are of the raw model distribution, taken before the bitmask and the
        processors change the copy in place. A batch of greedy rows that nothing changes or
        reads (no logprobs, bitmask, pending min_tokens or penalty) gets the logits as they are,
        in the model's dtype: its argmax is the fp32 copy's (the conversion is exact and keeps
        the order), without the copy's traffic (~2 GB a step at 750 rows of a 128k vocabulary).
        """
        if not lp_rows and token_bitmask is None and self._untouched_greedy(rows):
            return logits[:, : self.vocab_size], None
        logits = self._private_copy(logits)
        raw_logprobs = None
        if lp_rows:
            _, lp_logits = self._rows(logits, lp_rows)
            raw_logprobs = torch.log_softmax(lp_logits, dim=-1)
        if token_bitmask is not None:
            self._apply_bitmask(logits, token_bitmask)
        return self._process(logits, rows), raw_logprobs

    def _verify_greedy(
        self, logits: torch.Tensor, drafts: list[list[int]], starts: np.ndarray, ends: np.ndarray
    ) -> GreedyVerification:
        top = rows_argmax(logits, torch.int32)
        # On the device, each sequence's last row: the next input of a sequence that drafted
        # nothing (the one kind a later step may read from here before the host has it).
        last = top.index_select(0, self._upload(torch.from_numpy(ends - 1)))
        host, done, slot = _to_host_async(top, self._slots)
        n = len(drafts)
        return GreedyVerification(
            last, host, done, [None] * n, [], 0, [], _slot=slot, _drafts=drafts, _starts=starts.tolist()
        )

    @staticmethod
    def _untouched_greedy(rows: list[SamplingRow]) -> bool:
        """Every row greedy, and no stage 2-4 processor would change its logits."""
        if all(r.plain_greedy for r in rows):  # the common case: one attribute a row
            return True
        processed = (_min_tokens_pending, _repetition_penalised, _count_penalised)
        return all(r.params.greedy and not any(touches(r) for touches in processed) for r in rows)

    # -- logit processors (all rows, greedy included) -------------------------

    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Stages 2-4 (min_tokens, repetition, presence/frequency) on a copy: what greedy rows
        take the argmax of. `sample` runs the same code; this entry point is for tests and
        debugging."""
        return self._process(self._private_copy(logits), rows)

    def _process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        logits = self._apply_min_tokens(logits, rows)
        logits = self._apply_repetition_penalty(logits, rows)
        return self._apply_presence_frequency(logits, rows)

    # Each works in place on the sampler's private copy of the logits and returns it.

    def _apply_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        flat_idx: list[int] = []  # row * vocab + token, into the flattened logits
        for i, r in enumerate(rows):
            if not _min_tokens_pending(r):
                continue
            p = r.params
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned.update(r.eos_token_ids)
            for t in banned:
                if 0 <= t < self.vocab_size:  # stop ids outside the vocab can never be sampled anyway
                    flat_idx.append(i * self.vocab_size + t)
        if not flat_idx:
            return logits
        # index_fill_ takes the scalar as a kernel argument; `logits[rows, toks] = -inf` would
        # copy a host scalar to the device and synchronize.
        logits.view(-1).index_fill_(0, self._to_dev(flat_idx, torch.int64), _NEG_INF)
        return logits

    def _apply_repetition_penalty(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        sel = [i for i, r in enumerate(rows) if _repetition_penalised(r)]
        if not sel:
            return logits
        seen = torch.zeros(len(sel) * self.vocab_size, dtype=torch.bool, device=self.device)
        seen.index_fill_(
            0,
            self._flat_token_index([rows[i].prompt_token_ids + rows[i].output_token_ids for i in sel]),
            True,
        )
        seen = seen.view(len(sel), self.vocab_size)
        penalty = self._to_dev([rows[i].params.repetition_penalty for i in sel], torch.float32)[:, None]
        idx, sub = self._rows(logits, sel)
        # HF/vLLM: shrink towards zero, i.e. divide positive logits and multiply negative ones.
        penalized = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
        if idx is None:
            return penalized
        logits[idx] = penalized
        return logits

    def _apply_presence_frequency(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        sel = [i for i, r in enumerate(rows) if _count_penalised(r)]
        if not sel:
            return logits
        flat = self._flat_token_index([rows[i].output_token_ids for i in sel])
        counts = torch.zeros(len(sel) * self.vocab_size, dtype=torch.float32, device=self.device)
        # Adding 1.0s is exact in float32 whatever order the atomics run in.
        counts.index_add_(0, flat, torch.ones(flat.shape, dtype=torch.float32, device=self.device))
        counts = counts.view(len(sel), self.vocab_size)
        pres = self._to_dev([rows[i].params.presence_penalty for i in sel], torch.float32)[:, None]
        freq = self._to_dev([rows[i].params.frequency_penalty for i in sel], torch.float32)[:, None]
        idx, sub = self._rows(logits, sel)
        penalized = sub - freq * counts - pres * (counts > 0).float()
        if idx is None:
            return penalized
        logits[idx] = penalized
        return logits

    # -- random sampling (non-greedy rows only) -------------------------------

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        probs = self.filtered_probs(logits, rows)
        if probs.is_cuda:
            # One pass, the noise drawn in the kernel (kernels/triton/exponential_race.py): the
            # noise tensor, its clamp, the division and the argmax took ~0.7 ms a step at 256
            # rows of a 128k vocabulary on an H100.
            from kernels.triton.exponential_race import exponential_race

            return exponential_race(probs, self._race_seeds(rows))
        return rows_argmax(probs / self._exponential_noise(rows))

    def _race_seeds(self, rows: list[SamplingRow]) -> torch.Tensor:
        """int64 [R] on the device: each row's noise seed for `exponential_race`. Unseeded rows
        take this sampler's stream; a seeded row its seed and position (`seeded_draw_seed`), so
        its draw depends on neither the batch nor the other rows."""
        seeds = self._host_rng.integers(0, _MASK63, size=len(rows), dtype=np.int64, endpoint=True)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                seeds[i] = seeded_draw_seed(r.params.seed, len(r.output_token_ids))
        return self._upload(torch.from_numpy(seeds))

    def filtered_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """[R, V] the distribution each random row samples from: temperature, top_k, top_p, min_p."""
        vocab = self.vocab_size
        temps = [r.params.temperature for r in rows]
        fresh = any(t != 1.0 for t in temps)  # logits a tensor of this call's own, to mask in place
        if fresh:
            logits = logits / self._to_dev(temps, torch.float32)[:, None]

        ks = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]
        ps = [r.params.top_p for r in rows]
        need_k = any(k > 0 for k in ks)
        need_p = any(p < 1.0 for p in ps)
        # top_k, then top_p over what it left (renormalised, as vLLM). Each takes its cheap
        # path where it has one and clears its flag; a sort does whatever is left.
        if need_k and max(ks) <= self.TOPK_PATH_MAX_K:
            # top_k: a partial topk is far cheaper than sorting the whole vocabulary.
            # Scattering "keep" through the top indices keeps exactly k tokens even on ties.
            k_max = max(ks)
            k_dev = self._to_dev(ks, torch.int64)  # 0 = no top_k for this row
            top_idx = logits.topk(k_max, dim=-1, sorted=True).indices
            in_k = self._arange_v[:k_max][None, :] < k_dev[:, None]
            keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top_idx, in_k)
            keep |= (k_dev == 0)[:, None]
            logits = logits.masked_fill(~keep, _NEG_INF)
            need_k, fresh = False, True
        if need_p and not need_k and self._searches_nucleus(logits):
            # The nucleus without a sort (kernels/triton/top_p.py): a step at 256 rows of a 128k
            # vocabulary sampled in 4.6 ms on an H100 with the sort, 1.8 ms with the search.
            from kernels.triton.top_p import top_p_mask_

            own = logits if fresh else logits.clone()
            logits = top_p_mask_(own, self._to_dev(ps, torch.float32))
            need_p = False
        if need_k or need_p:
            # One ascending sort serves both filters; masks are built in sorted space and
            # scattered back, so top_k keeps exactly k tokens even when logits tie.
            sorted_logits, sorted_idx = logits.sort(dim=-1)
            if need_k:
                keep = self._to_dev([k if k > 0 else vocab for k in ks], torch.int64)
                drop = self._arange_v[None, :] < (vocab - keep)[:, None]
                sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
            if need_p:
                # Nucleus: drop the low tail whose total mass is <= 1 - top_p (renormalised
                # after top_k, as vLLM); the most likely token always stays.
                cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
                tail = self._to_dev([1.0 - p for p in ps], torch.float32)[:, None]
                drop = cum <= tail
                drop[:, -1] = False
                sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
            logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)

        min_ps = [r.params.min_p for r in rows]
        if any(mp > 0.0 for mp in min_ps):
            # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p) (after temperature);
            # in log space it does not matter that top_k/top_p already renormalised.
            log_min_p = self._to_dev([math.log(mp) if mp > 0 else _NEG_INF for mp in min_ps], torch.float32)
            threshold = logits.amax(dim=-1, keepdim=True) + log_min_p[:, None]
            logits = logits.masked_fill(logits < threshold, _NEG_INF)

        return logits.softmax(dim=-1)

    def _searches_nucleus(self, logits: torch.Tensor) -> bool:
        """Whether top_p takes the search kernels instead of a sort: on CUDA, from
        `NUCLEUS_SEARCH_MIN_ROWS` rows. A sampling step with top_p 0.9 over a 128k vocabulary
        on an H100, GPU time search / sort: 1 row 158 / 200 us, 16 rows 244 / 584, 32 rows
        315 / 856, 256 rows 1.8 / 4.6 ms. The search is eleven launches, ~0.4 ms of host time
        more than the sort's: few rows, where it saves little, keep the sort (a small model's
        batch-1 step is bound by its host). Ties at the nucleus' edge stay or go together in
        the search; a sort keeps some of them."""
        on_device = logits.is_cuda or self.NUCLEUS_SEARCH_ON_CPU
        return on_device and logits.shape[0] >= self.NUCLEUS_SEARCH_MIN_ROWS

    def _exponential_noise(self, rows: list[SamplingRow]) -> torch.Tensor:
        """[R, V] Exp(1) noise: unseeded rows in one draw, seeded rows each from their own seed."""
        vocab = self.vocab_size
        noise = torch.empty(len(rows), vocab, dtype=torch.float32, device=self.device)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if len(unseeded) == len(rows):
            noise.exponential_(generator=self._gen)
        elif unseeded:
            block = torch.empty(len(unseeded), vocab, dtype=torch.float32, device=self.device)
            block.exponential_(generator=self._gen)
            noise[self._to_dev(unseeded, torch.int64)] = block
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                self._seeded_gen.manual_seed(seeded_draw_seed(r.params.seed, len(r.output_token_ids)))
                # Always a fresh contiguous [V] draw, so the values cannot depend on the batch.
                noise[i] = torch.empty(vocab, dtype=torch.float32, device=self.device).exponential_(
                    generator=self._seeded_gen
                )
        # Exp(1) noise of exactly 0 would turn a zero probability into 0/0 = nan.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _uniform(self, rows: list[SamplingRow]) -> torch.Tensor:
        """[R] U(0, 1) draws for accepting drafts: unseeded rows in one draw, seeded rows by position."""
        u = torch.empty(len(rows), dtype=torch.float32, device=self.device).uniform_(generator=self._gen)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                self._seeded_gen.manual_seed(seeded_draw_seed(~r.params.seed, len(r.output_token_ids)))
                u[i] = torch.empty(1, dtype=torch.float32, device=self.device).uniform_(
                    generator=self._seeded_gen
                )[0]
        return u

    # -- results ------------------------------------------------------------

    def _gather_results(
        self,
        sampled: torch.Tensor,
        raw_logprobs: torch.Tensor | None,  # [L, V], rows of lp_rows
        rows: list[SamplingRow],
        lp_rows: list[int],
        num_accepted: torch.Tensor | None = None,  # [rows], a verification's accepted drafts
    ) -> SampledIds:
        """Start the one device->host copy of the results; `SampledIds.wait()` reads them."""
        sampled = sampled.to(torch.int32)
        k_max = 0
        if raw_logprobs is None:
            packed = sampled
        else:
            # Pack everything into one int32 tensor (floats bit-cast, not converted) so that
            # the step costs a single device->host copy.
            k_max = max(rows[i].params.logprobs or 0 for i in lp_rows)
            lp = raw_logprobs
            _, tok = self._rows(sampled, lp_rows)
            tok = tok.long()
            tok_lp = lp.gather(1, tok[:, None])  # [L, 1]
            # Rank 1 = most likely; tokens tied with the sampled one do not push it down.
            rank = (lp > tok_lp).sum(dim=-1, dtype=torch.int32) + 1
            parts = [sampled, tok_lp[:, 0].view(torch.int32), rank]
            if k_max > 0:
                top_lp, top_ids = lp.topk(k_max, dim=-1)
                parts += [top_ids.to(torch.int32).reshape(-1), top_lp.reshape(-1).view(torch.int32)]
            packed = torch.cat(parts)
        if num_accepted is not None:
            packed = torch.cat([packed, num_accepted.to(torch.int32)])
        host, done, slot = _to_host_async(packed, self._slots)
        accepted = [] if num_accepted is not None else None
        logprobs = [r.params.logprobs for r in rows]
        return SampledIds(sampled, host, done, logprobs, lp_rows, k_max, accepted, slot)

    def sample(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sampled token ids (and logprobs) of each row; waits for the device."""
        return self.sample_async(logits, rows).wait()
