"""Grammar state of constrained sequences: compiled-grammar cache, per-sequence matchers, bitmasks.

The worker holds it because the worker sees each sampled token first: the mask of token N+1
is filled from the matcher that just accepted token N, with no round trip to the scheduler.
The engine is llguidance (see services/structured_outputs.py).

- Compiling is off the step's critical path: a sequence's matcher is built on a background
  thread when the sequence arrives (its prompt's prefill runs meanwhile); the step that first
  samples it waits only for what is left. Compiled grammars are cached by the spec's hash; a
  sequence gets a cheap copy of a cached matcher.
- A copy shares its template's lexer, and with it the lock that every mask computation holds
  from start to end (llguidance's `LLMatcher.deep_copy` clones the parser's
  `Arc<Mutex<SharedState>>`, not what it holds), so a batch's rows of one spec are filled one
  at a time whatever the fill's threads. A spec is therefore compiled into a few independent
  templates ("lexer families", by default one per fill thread) and its sequences are dealt out
  among them. Issue 31: at batch 32 every run's first fill after the prefill (each row's first
  mask after its first token: ~0.4 ms of CPU a row, nothing cached) held the step thread 23.7 ms
  on an H100 host, 4 fill threads, one family, while the forward it could hide behind is ~6 ms.
- A recomputed sequence (preempted, or moved to this worker) arrives with its output so far:
  its matcher replays those tokens.
- `rollback(n)` undoes accepted tokens (for speculative decoding's rejected drafts).
- A matcher that stopped (the grammar is complete and EOS was taken) or failed (a token it
  refused, or the engine's parser limits) lets only EOS through, so the choice ends; the token
  the scheduler may still plan after EOS never reaches a caller.
- A batch's masks are filled on a thread of their own (`bitmask_async`): the engine's fill
  releases the GIL, and the step thread, which would sit waiting to get it back from the other
  Python threads (issue 31), hands the step's result over and launches meanwhile.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from services.structured_outputs import StructuredOutputs, parser_limits

log = logging.getLogger(__name__)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class SequenceGrammar:
    """One sequence's matcher (ready once its compile finished)."""

    def __init__(self, future: Future, eos_token_ids: Sequence[int], family: int = 0) -> None:
        self._future = future
        self.family = family  # which of its spec's independent templates it was copied from
        self._matcher: Any = None  # the future's result, once it has one
        self._eos = list(eos_token_ids)
        self._failed = False
        self.num_accepted = 0

    @property
    def matcher(self) -> Any:
        # Read a few times per row and step: Future.result takes a lock each time (~0.1 ms a
        # step at batch 32, on the step thread).
        if self._matcher is None:
            self._matcher = self._future.result()  # re-raises a compile failure
        return self._matcher

    @property
    def done(self) -> bool:
        """Nothing but EOS may follow (the grammar stopped, or the matcher failed)."""
        return self._failed or self.matcher.is_stopped() or self.matcher.is_error()

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False (and EOS only from now on) if the grammar refused it."""
        if self._failed:
            return False
        try:
            m = self.matcher
        except Exception as e:
            log.warning("grammar compile failed; the sequence ends: %s", e)
            self._failed = True
            return False
        if m.is_stopped():
            return token_id in self._eos
        if not m.consume_token(token_id):
            log.warning("grammar refused token %d: %s", token_id, m.get_error()[:200])
            self._failed = True
            return False
        self.num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (rejected speculative drafts)."""
        if num_tokens <= 0 or self._failed:
            return
        if num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens, {self.num_accepted} accepted")
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def fill_eos_only(self, row: torch.Tensor) -> None:
        row.zero_()
        for t in self._eos:
            if 0 <= t < row.numel() * 32:
                row[t >> 5] |= _bit(t & 31)


def executor_threads() -> int:
    """Threads that fill a batch's masks: a few. A fill is microseconds a row for common
    grammars, and llguidance's default (80 % of the cores) leaves that many threads spinning
    on the cores the step thread and torch's own threads need right after."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _bit(i: int) -> int:
    # Bit 31 of an int32 is its sign bit.
    return -(1 << 31) if i == 31 else 1 << i


class MaskFill:
    """A batch's host bitmask whose grammar rows are being filled on the fill thread."""

    def __init__(self, mask: torch.Tensor, future: Future | None) -> None:
        self._mask = mask
        self._future = future  # None: nothing left to fill (no live grammar row)

    def result(self) -> torch.Tensor:
        """The mask, once filled (waits for the fill; re-raises its failure)."""
        if self._future is not None:
            self._future.result()
            self._future = None
        return self._mask


class StructuredOutputManager:
    """Per worker: the tokenizer for the engine (built lazily), the grammar cache, the executor."""

    def __init__(
        self,
        load_tokenizer: Any,  # () -> HF fast tokenizer, called once, on a background thread
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = 256,
        compile_threads: int = 2,
        pin_memory: bool = False,
        families: int | None = None,
        fill_threads: int | None = None,
    ) -> None:
        """`pin_memory`: fill the masks in page-locked memory (the worker's device is CUDA).
        `fill_threads`: the engine's threads for a batch's fill (default `executor_threads()`);
        `families`: independent templates per spec (default: one per fill thread)."""
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory
        self.width = bitmask_width(vocab_size)
        self._load_tokenizer = load_tokenizer
        self._eos = list(eos_token_ids)
        self._cache_size = cache_size
        self.fill_threads = fill_threads if fill_threads is not None else executor_threads()
        self.families = families if families is not None else self.fill_threads
        self._next_family = 0
        # (spec key, family) -> template matcher
        self._cache: OrderedDict[tuple[str, int], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="grammar")
        self._tokenizer: Future | None = None
        self._tokenizer_pool: ThreadPoolExecutor | None = None
        self._executor: Any = None  # llguidance.LLExecutor: fills a batch's masks on its threads
        # One thread that runs the executor's fills: a batch's fill is one call, and one at a time
        # keeps the fill from ever overlapping itself on the same matchers.
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")

    # -- compile (background) ---------------------------------------------------

    def _tokenizer_future(self) -> Future:
        # Its own thread: compile tasks wait on it, so it must never queue behind them.
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-tok")
                self._tokenizer = self._tokenizer_pool.submit(self._build_tokenizer)
            return self._tokenizer

    def _build_tokenizer(self) -> Any:
        import llguidance.hf

        hf = self._load_tokenizer()
        if hf is None:
            raise RuntimeError("the model ships no tokenizer: structured outputs need one")
        return llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size)

    def _template(self, spec: StructuredOutputs, family: int) -> Any:
        """The spec's compiled matcher of `family` (runs on a pool thread). The first thread to ask
        compiles it; the others wait on a thread that is running, never on a queued task."""
        key = (spec.key, family)
        with self._lock:
            fut = self._cache.get(key)
            owner = fut is None
            if owner:
                fut = self._cache[key] = Future()
                while len(self._cache) > self._cache_size * max(1, self.families):
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                fut.set_result(self._compile(spec))
            except Exception as e:  # cached too: the same spec fails the same way
                fut.set_exception(e)
        return fut.result()

    def _compile(self, spec: StructuredOutputs) -> Any:
        import llguidance

        tokenizer = self._tokenizer_future().result()
        matcher = llguidance.LLMatcher(tokenizer, spec.to_llguidance(), limits=parser_limits())
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        # A matcher keeps its last mask while its state is unchanged, and a deep copy keeps it
        # too: computed once here, every sequence's first mask comes free. Otherwise each copy
        # computes it (the benchmark's regex: ~0.4 ms CPU a row, 32 rows at batch 32).
        matcher.compute_bitmask()
        return matcher

    def start(self, spec: StructuredOutputs, output_token_ids: Sequence[int] = ()) -> SequenceGrammar:
        """A sequence's grammar, compiled in the background; `output_token_ids` are replayed."""
        replay = list(output_token_ids)
        with self._lock:
            family = self._next_family % max(1, self.families)
            self._next_family = family + 1

        def build() -> Any:
            m = self._template(spec, family).deep_copy()
            for t in replay:
                if not m.consume_token(t):
                    break  # stays in error: EOS only
            return m

        seq = SequenceGrammar(self._pool.submit(build), self._eos, family)
        seq.num_accepted = len(replay)
        return seq

    # -- per step -----------------------------------------------------------------

    def bitmask(self, grammars: Sequence[SequenceGrammar | None]) -> torch.Tensor | None:
        """Host int32 [rows, width] allowed-token bits (all ones for free rows); None if no row
        is constrained. Waits for matchers still compiling, and for the fill."""
        prepared = self._prepare(grammars)
        if prepared is None:
            return None
        mask, live = prepared
        if live:  # on this thread: a hop to the fill thread would only add a wait for the GIL
            self._fill(live, mask)
        return mask

    def bitmask_async(self, grammars: Sequence[SequenceGrammar | None]) -> MaskFill | None:
        """As `bitmask`, the grammar rows filled on the fill thread: until `result()`, the caller
        must not advance or roll back these grammars. Waits for matchers still compiling."""
        prepared = self._prepare(grammars)
        if prepared is None:
            return None
        mask, live = prepared
        if not live:
            return MaskFill(mask, None)
        # The task holds `mask` until the engine has written it, whatever becomes of the MaskFill.
        return MaskFill(mask, self._fill_pool.submit(self._fill, live, mask))

    def _prepare(
        self, grammars: Sequence[SequenceGrammar | None]
    ) -> tuple[torch.Tensor, list[tuple[Any, int]]] | None:
        """(the mask with free and finished rows set, the live rows' (matcher, row) left to fill);
        None if no row is constrained."""
        if not any(g is not None for g in grammars):
            return None
        # Page-locked on CUDA: a copy from pageable memory this large (~0.5 MB at 32 rows of a
        # 128k vocabulary) goes through the driver's staging buffers and held the step thread
        # until the forward queued before it had run, which undid the launch-ahead at batch 32.
        # torch's host caching allocator reuses a block only once its copy has completed.
        mask = torch.empty((len(grammars), self.width), dtype=torch.int32, pin_memory=self.pin_memory)
        # numpy's fill, on this thread: torch.full of a mask this large (32 rows of a 128k
        # vocabulary) is an OpenMP parallel region, whose threads wait behind the grammar
        # executor's still spinning right after a fill: ms per step at batch 32 (issue 31).
        mask.numpy().fill(-1)
        live: list[tuple[Any, int]] = []
        families: list[int] = []
        for i, g in enumerate(grammars):
            if g is None:
                continue
            try:
                done = g.done
            except Exception as e:  # the compile failed after the up-front check passed
                log.warning("grammar compile failed; the sequence ends: %s", e)
                g._failed = True
                done = True
            if done:
                g.fill_eos_only(mask[i])
            else:
                live.append((g.matcher, i))
                families.append(g.family)
        # Rows of a family next to each other: the executor splits the list into contiguous
        # chunks, one per thread, so each thread mostly takes the lock of a family of its own.
        order = sorted(range(len(live)), key=families.__getitem__)
        return mask, [live[j] for j in order]

    def _fill(self, live: list[tuple[Any, int]], mask: torch.Tensor) -> None:
        """The engine writes each live row's bits (the GIL released meanwhile)."""
        with self._lock:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor(num_threads=self.fill_threads)
        self._executor.unsafe_compute_mask_ptr(live, mask.data_ptr(), self.width * 4, mask.shape[0])

    def close(self) -> None:
        """Stop the compile threads (a compile still running finishes first)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._fill_pool.shutdown(wait=True)  # a fill writes into its mask until it returns
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.shutdown(wait=True, cancel_futures=True)
