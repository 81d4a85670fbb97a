"""What rank 0 of a tensor-parallel worker tells the other ranks each step, and its bytes.

Rank 0 holds the Step stream and every sequence's state; the other ranks hold none. Per step
rank 0 sends them the forward's host inputs it has just built (token ids, positions, KV slots,
context lengths, block tables, the rows to sample), so every rank runs the same forward on its
shard without planning anything itself.

They travel over each rank's stdin pipe, not over a collective: an idle worker's ranks block on
a pipe read, which never times out however long the worker idles, and which ends (EOF) the
moment rank 0 dies, so no rank outlives its worker. A message is a length-prefixed frame of raw
integer arrays, each with a dtype code and its shape (never pickle).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

STEP = 1
STOP = 2
# KV tiers (worker_svc.kv_shards): gather these blocks' heads to rank 0 / take them from it.
KV_GATHER = 3
KV_SCATTER = 4
# LoRA (worker_svc.lora.slots): load the adapter in this folder into this slot, as rank 0 just did.
LORA_LOAD = 5

_CODES = {np.dtype(np.int64): 0, np.dtype(np.int32): 1}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_LEN = struct.Struct("<Q")
_HEAD = struct.Struct("<BB")
MAX_MESSAGE_BYTES = 1 << 31  # a frame larger than this is corruption, not a step


def encode(kind: int, arrays: list[np.ndarray]) -> bytes:
    parts = [_HEAD.pack(kind, len(arrays))]
    for a in arrays:
        a = np.ascontiguousarray(a)
        if a.dtype not in _CODES:
            raise TypeError(f"rank messages carry int32/int64 arrays, not {a.dtype}")
        parts.append(_HEAD.pack(_CODES[a.dtype], a.ndim))
        parts.append(struct.pack(f"<{a.ndim}q", *a.shape))
        parts.append(a.tobytes())
    body = b"".join(parts)
    return _LEN.pack(len(body)) + body


def _read_exact(f: BinaryIO, n: int) -> bytearray | None:
    # A bytearray: the arrays are views into it and must be writable (the forward patches ids).
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def read_message(f: BinaryIO) -> tuple[int, list[np.ndarray]] | None:
    """The next (kind, arrays) from `f`, or None when the writer is gone (EOF)."""
    head = _read_exact(f, _LEN.size)
    if head is None:
        return None
    (size,) = _LEN.unpack(head)
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"rank message of {size} bytes: the channel is corrupt")
    body = _read_exact(f, size)
    if body is None:
        return None
    kind, count = _HEAD.unpack_from(body, 0)
    off = _HEAD.size
    arrays = []
    for _ in range(count):
        code, ndim = _HEAD.unpack_from(body, off)
        off += _HEAD.size
        shape = struct.unpack_from(f"<{ndim}q", body, off)
        off += 8 * ndim
        dtype = _DTYPES[code]
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        flat = np.frombuffer(body, dtype=dtype, count=nbytes // dtype.itemsize, offset=off)
        arrays.append(flat.reshape(shape))
        off += nbytes
    return kind, arrays


_EMPTY = np.zeros(0, dtype=np.int64)
_NO_LORA = np.zeros(0, dtype=np.int32)

# How a step's forward runs (`ModelExecutor.forward`): eagerly, or by replaying the captured
# decode graphs, or the verification graphs (q rows per sequence, speculative decoding).
EAGER = 0
DECODE_GRAPH = 1
VERIFY_GRAPH = 2


@dataclass
class ForwardInputs:
    """One step's forward, as rank 0 built it on the host (`step_inputs.prepare_step`).

    `mode`: a graph replay (`DecodeGraphs.run` takes ids, positions, slots, seq_lens, tables;
    for `VERIFY_GRAPH` already padded to q rows per sequence), or `EAGER`, a forward that also
    needs the query start offsets and lengths. `sample_index`: the rows of the hidden states to
    take logits of (None: every row); `num_sampled` = 0 means no logits at all. `patch_where`:
    positions in `ids` whose token is still on rank 0's device (it broadcasts them after this
    message). Every rank runs it alike (`ModelExecutor.forward`).
    """

    mode: int
    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    seq_lens: np.ndarray  # int32
    tables: np.ndarray  # int32 [n, width]
    num_sampled: int
    sample_index: np.ndarray | None = None
    query_start_loc: np.ndarray = field(default_factory=lambda: _EMPTY)  # int32, eager only
    query_lens: np.ndarray = field(default_factory=lambda: _EMPTY)  # eager only
    max_query_len: int = 1
    max_seq_len: int = 0
    patch_where: np.ndarray = field(default_factory=lambda: _EMPTY)
    # Each input row's LoRA slot (-1: the base model; int32); None: no row uses an adapter.
    lora_slots: np.ndarray | None = None

    def encode(self) -> bytes:
        scalars = np.array(
            [
                self.mode,
                self.num_sampled,
                int(self.sample_index is not None),
                self.max_query_len,
                self.max_seq_len,
            ],
            dtype=np.int64,
        )
        sample_index = self.sample_index if self.sample_index is not None else _EMPTY
        return encode(
            STEP,
            [
                scalars,
                self.ids,
                self.positions,
                self.slots,
                self.seq_lens,
                self.tables,
                sample_index,
                self.query_start_loc,
                self.query_lens,
                self.patch_where,
                self.lora_slots if self.lora_slots is not None else _NO_LORA,
            ],
        )

    @classmethod
    def decode(cls, arrays: list[np.ndarray]) -> ForwardInputs:
        scalars, ids, positions, slots, seq_lens, tables, sample_index, qsl, query_lens, where, lora = arrays
        mode, num_sampled, has_index, max_query_len, max_seq_len = (int(v) for v in scalars)
        return cls(
            mode=mode,
            ids=ids,
            positions=positions,
            slots=slots,
            seq_lens=seq_lens,
            tables=tables,
            num_sampled=num_sampled,
            sample_index=sample_index if has_index else None,
            query_start_loc=qsl,
            query_lens=query_lens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            patch_where=where,
            lora_slots=lora if lora.size else None,  # a step with adapter rows has rows
        )
