"""Pure-decode steps replayed from CUDA graphs captured once per batch size.

A decode step of a large model is a few hundred small kernels; launched one by one from
Python they cost more host time than the GPU spends on them at small batches. So at start
each rank's `ModelExecutor` records the whole model forward (not the sampler) for each capture
size (1, 2, 4, ..., 128, then every 32 to 512 and every 64 beyond, up to max_num_seqs:
`capture_sizes`) into a CUDA graph over persistent input buffers, and a decode batch of n
sequences replays the smallest graph of size >= n:

* inputs go to fixed addresses: token ids, positions and slots in one [3, B_max] int64
  buffer, context lengths in [B_max] int32, the block table in [B_max, max_blocks] int32,
  `query_start_loc` = arange (a decode has one query per sequence) set once. On CUDA the host
  writes a step's inputs into page-locked memory and one kernel places them (and the ids a
  step still running sampled): through the copy engine and copy kernels they held the stream
  ~28 us a batch-1 step on an H100;
* padding rows (n <= row < B) get slot -1, which the Triton KV write skips, context length
  1 and block 0: they read one finite cached value and write nothing;
* the attention's host-side choices are frozen at capture: one query per sequence and the
  split-K segment count for the longest context (`max_seq_len = max_model_len`); the kernel
  divides each sequence's own context among the segments, so any shorter context is right.

Speculative decoding adds a second set (`query_len` = 1 + num_speculative_tokens): every
sequence of a verification step gets that many query rows, its drafts (and, for sequences
with fewer, padding rows with slot -1 and a clamped position) after its last token; a
sequence's context is `seq_len - query_len`, so padding rows read past its end and are never
sampled. A small model's eager verification is launch-bound (several times a graph step),
which would eat what the drafts gain.

Only the Triton attention backend is capturable (the reference backend reads host lists of
lengths that change every step). With `capture=False` the same padded, static-buffer path
runs eagerly: that is how the CPU tests check the padding logic without a GPU.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels import reference
from kernels.attention_metadata import AttentionMetadata
from kernels.triton.pinned_io import fill_decode_inputs
from worker_svc.models.parallel_layers import decode_graph_gemms
from worker_svc.pinned_slots import PinnedSlots

if TYPE_CHECKING:
    from worker_svc.executor import ModelExecutor, Patch

log = logging.getLogger(__name__)


# Decode batches past this many rows are bound by the GEMMs' arithmetic, not by reading the
# weights (an 8B bf16 decode on an H100 turns over at ~250 rows): each padding row there costs
# as much as a real one, so the sizes above it are spaced by a fraction of the batch instead of
# doubling. ShareGPT-shaped runs at 1,024 sequences decode most of their heavy steps at 257-1,024
# rows: padded to powers of two they did ~15 % more GEMM work than the rows (0.99 s of a 6.7 s
# decode-GEMM floor); at these steps ~2 % (0.12 s), for 28 graphs at 1,024 instead of 11.
_DOUBLING_UP_TO = 128


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Graph sizes for decode batches of up to `max_num_seqs` sequences, `max_num_seqs` included:
    powers of two up to 128, then every 32 up to 512, then every 64 (1, 2, 4, ..., 128, 160,
    192, ..., 512, 576, ..., max)."""
    sizes = []
    b = 1
    while b < max_num_seqs:
        sizes.append(b)
        b = b * 2 if b < _DOUBLING_UP_TO else b + (32 if b < 512 else 64)
    sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(
        self, executor: ModelExecutor, sizes: list[int], capture: bool = True, query_len: int = 1
    ) -> None:
        # What it reads of the executor: device, max_blocks_per_seq, max_model_len, model,
        # kv_caches and draft.
        self.executor = executor
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.capture_enabled = capture
        self.q = query_len  # query rows per sequence (1: decode; 1 + drafts: verification)
        dev = executor.device
        b = self.max_size
        self.width = executor.max_blocks_per_seq
        # Row 0: token ids, row 1: positions, row 2: slots (-1: padding, not written).
        self.i64 = torch.zeros((3, b * self.q), dtype=torch.long, device=dev)
        self.i64[2].fill_(-1)
        self.seq_lens = torch.full((b,), self.q, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev) * self.q
        self.block_tables = torch.zeros((b, self.width), dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        # Each step's inputs on their way in (`_place_inputs`): staged in host memory (page-locked
        # on CUDA), then placed by one kernel on CUDA, by its twin's torch copies elsewhere (tests
        # switch the kernel on for the CPU: it runs under the interpreter).
        self.kernel_places_inputs = dev.type == "cuda"
        self.pinned = PinnedSlots(pin=dev.type == "cuda")

    def release(self) -> None:
        """Reset every graph (their shared pool goes back to the allocator once the last is reset)
        and drop the static buffers and the executor (a cycle: the executor holds these graphs)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        empty = torch.empty(0, device=self.i64.device)
        self.i64 = self.seq_lens = self.query_start_loc = self.block_tables = empty
        self.executor = None  # type: ignore[assignment]

    def padded_size(self, n: int) -> int:
        for b in self.sizes:
            if b >= n:
                return b
        raise ValueError(f"decode batch of {n} exceeds the largest capture size {self.max_size}")

    def _meta(self, b: int) -> AttentionMetadata:
        max_len = self.executor.max_model_len
        t = b * self.q
        return AttentionMetadata(
            slot_mapping=self.i64[2, :t],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            max_query_len=self.q,
            max_seq_len=max_len,  # split-K sized for the longest context the graph may see
            query_lens_cpu=[self.q] * b,
            seq_lens_cpu=[max_len] * b,
        )

    def _forward(self, b: int) -> torch.Tensor:
        r = self.executor
        meta = self._meta(b)
        t = b * self.q
        hidden = r.model(self.i64[0, :t], self.i64[1, :t], r.kv_caches, meta)
        if r.draft is not None:  # a draft model's KV follows the target's in the same graph
            r.draft.forward_alongside(self.i64[0, :t], self.i64[1, :t], meta)
        return hidden

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles the Triton kernels of each shape) and capture every size, largest
        first so that the smaller graphs reuse the larger ones' memory from the shared pool."""
        if not self.capture_enabled:
            return
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Capture inputs are padding rows throughout: nothing is written to the KV cache.
        for b in reversed(self.sizes):
            # The warm-up compiles the skinny GEMMs the capture records (decode_gemms).
            with decode_graph_gemms():
                for _ in range(2):
                    self._forward(b)
            torch.cuda.synchronize(self.executor.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the NCCL process group's watchdog thread polls the events of earlier
            # collectives, a call that the default (global) mode counts as an error in the capture.
            with decode_graph_gemms(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = self._forward(b)
            self.graphs[b] = graph
            self.outputs[b] = out
        torch.cuda.synchronize(self.executor.device)
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d decode graphs in %.1f s", len(self.sizes), self.capture_seconds)

    def run(
        self,
        ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        tables: np.ndarray,
        patch: Patch | None = None,
    ) -> torch.Tensor:
        """Hidden states [n * q, hidden] of a batch of n = len(seq_lens) sequences.

        ids, positions and slots hold q rows per sequence (q = 1: one decode token each).

        `patch` overwrites input ids with tokens a previous step sampled that the host has not
        read yet.

        `tables` is [n, w] with w the widest block count this step; columns beyond w in the
        static table keep stale values that no sequence reads (it stops at its own length).
        """
        n = seq_lens.shape[0]
        b = self.padded_size(n)
        self._place_inputs((ids, positions, slots, seq_lens, tables), b, patch)
        if b in self.graphs:
            self.graphs[b].replay()
            out = self.outputs[b]
        else:
            out = self._forward(b)
        return out[: n * self.q]

    def _place_inputs(self, arrays: tuple[np.ndarray, ...], b: int, patch: Patch | None) -> None:
        """The step's inputs (`run`'s arrays, padded to b sequences) written into one host buffer,
        then placed in the static buffers. On CUDA one kernel reads the buffer page-locked
        (`kernels.triton.pinned_io`): no copy-engine transfer, no copy kernels."""
        ids, positions, slots, seq_lens, tables = arrays
        n, w = tables.shape
        rows, t = n * self.q, b * self.q
        n_patch = 0 if patch is None else patch.moves.shape[1]
        i64_bytes = (3 * t + 2 * n_patch) * 8
        slot = self.pinned.take(i64_bytes + (b + b * w) * 4)
        buf = slot.buffer
        i64 = buf[:i64_bytes].view(torch.int64)
        src_i64 = i64[: 3 * t].view(3, t)
        a = src_i64.numpy()
        a[0, :rows], a[1, :rows], a[2, :rows] = ids, positions, slots
        a[:2, rows:] = 0
        a[2, rows:] = -1  # padding rows: not written
        src_i32 = buf[i64_bytes : i64_bytes + (b + b * w) * 4].view(torch.int32)
        v = src_i32.numpy()
        v[:n] = seq_lens
        v[n:b] = self.q  # padding sequences: no context, q rows
        table = v[b:].reshape(b, w)
        table[:n] = tables
        table[n:] = 0
        on_host = None
        if patch is not None:
            moves = i64[3 * t :].view(2, n_patch)
            moves.numpy()[:] = patch.moves
            on_host = (moves, patch.sampled)
        place = fill_decode_inputs if self.kernel_places_inputs else reference.fill_decode_inputs
        place(self.i64, self.seq_lens, self.block_tables, src_i64, src_i32, b, w, on_host)
        slot.record()
