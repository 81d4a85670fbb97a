"""A step's forward inputs, built on the host from the sequences it runs: numpy only.

The runner hands `prepare_step` the plan's sequences in order with their new token counts;
it returns the `ForwardInputs` that every tensor-parallel rank runs (`ModelExecutor.forward`)
and what rank 0 needs to sample: which sequences sample, the drafts each verifies, and where
a token still on the device (sampled by the step in flight) goes in the inputs.

Host work per step is vectorised (ARCHITECTURE principle 7): each sequence holds a row of a
host block table (`BlockTableRows`) filled as its blocks arrive, and positions, KV slots and
sample indices come from numpy over the whole batch. Nothing here touches a device or a
sequence's state, so every case is a unit test without a GPU.

Which forward runs is chosen here too, from the shapes of the captured graphs:
* a pure decode that fits the decode graphs replays them (`DECODE_GRAPH`);
* a verification whose sequences all sample, that fits the verification graphs, replays them
  with q rows per sequence (`VERIFY_GRAPH`): its inputs are padded here;
* anything else runs eagerly (`EAGER`), with query start offsets and lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from worker_svc.rank_channel import DECODE_GRAPH, EAGER, VERIFY_GRAPH, ForwardInputs


def round16(n: int) -> int:
    """`n` up to a multiple of 16: Triton specialises integer arguments (a block table's row
    stride among them) on divisibility by 16, so varying widths would compile new variants."""
    return (n + 15) // 16 * 16


class BlockTableRows:
    """One row per live sequence of a host int32 block table, filled incrementally."""

    def __init__(self, width: int, rows: int = 64) -> None:
        self.table = np.zeros((rows, width), dtype=np.int32)
        self.lens = np.zeros(rows, dtype=np.int64)
        self.free = list(range(rows - 1, -1, -1))

    def alloc(self, block_ids: list[int]) -> int:
        if not self.free:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
            self.free = list(range(2 * old - 1, old - 1, -1))
        row = self.free.pop()
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.lens[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            grown = np.zeros(
                (self.table.shape[0], round16(max(end, 2 * self.table.shape[1]))), dtype=np.int32
            )
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown
        self.table[row, start:end] = block_ids
        self.lens[row] = end

    def release(self, row: int) -> None:
        # Zero the row so that a later occupant's unread tail holds valid block ids (0).
        self.table[row, : int(self.lens[row])] = 0
        self.lens[row] = 0
        self.free.append(row)

    def clear(self) -> None:
        self.table[:] = 0
        self.lens[:] = 0
        self.free = list(range(self.table.shape[0] - 1, -1, -1))


class SequenceView(Protocol):
    """What input preparation reads of a sequence (`runner.SequenceState`); it writes nothing."""

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    row: int  # its row of the host block table
    inflight: object | None  # the unfinished step that samples its next token, if any
    inflight_row: int  # that token's row among the unfinished step's sampled ids
    drafts: list[int]
    draft_start: int


class GraphShape(Protocol):
    """What a set of captured graphs accepts (`cuda_graphs.DecodeGraphs`)."""

    max_size: int  # sequences
    width: int  # block-table columns
    q: int  # query rows per sequence


@dataclass
class StepInputs:
    forward: ForwardInputs
    sample_seqs: list[int]  # index in the order of each sequence that samples
    verified: list[list[int]]  # per sampling sequence: the drafts it verifies
    outputs_before: list[int]  # per sampling sequence: its output tokens before this step
    # [2, k] int64: input positions (of `forward.ids`) whose token the step in flight samples,
    # and its rows among that step's sampled ids; None when every input is on the host.
    patch_moves: np.ndarray | None = None
    patch_seq: int = -1  # index in the order of a sequence with such a token

    @property
    def num_verified(self) -> int:
        return sum(len(d) for d in self.verified)


_NO_PATCH = np.zeros(0, dtype=np.int64)


def prepare_step(
    order: Sequence[tuple[SequenceView, int]],
    table: np.ndarray,
    block_size: int,
    max_model_len: int,
    decode_graphs: GraphShape | None = None,
    verify_graphs: GraphShape | None = None,
) -> StepInputs:
    """The inputs of a forward over `order` = [(sequence, number of new tokens)], non-empty.

    A sequence whose new tokens run past its known ones verifies its drafts there (and one
    whose token is still on the device gets a placeholder 0 that the device patches); one whose
    new tokens reach its end samples. Raises ValueError for tokens a sequence lacks.
    """
    bs = block_size
    n = len(order)
    starts = np.empty(n, dtype=np.int64)
    query_lens = np.empty(n, dtype=np.int64)
    rows = np.empty(n, dtype=np.int64)
    input_ids: list[int] = []
    sample_rows: list[int] = []  # index in the batch of the sequences that sample
    verified: list[list[int]] = []
    outputs_before: list[int] = []
    # (index in input_ids, row of the previous step's sampled ids) for tokens still in flight.
    from_device: list[tuple[int, int]] = []
    patch_seq = -1
    pure_decode = True
    for i, (st, num_new) in enumerate(order):
        start = st.num_computed_tokens
        end = start + num_new
        known = len(st.token_ids)
        inflight = st.inflight is not None
        base = known + inflight  # its tokens, the one still on the device included
        drafts: list[int] = []
        if end > base:  # past its tokens: verify drafts (proposed perhaps a token before)
            skip, want = base - st.draft_start, end - base
            drafts = st.drafts[skip : skip + want] if skip >= 0 else []
            if len(drafts) < want:
                # A later proposal replaced the drafts the plan counted (they were made while
                # a step was in flight): fill up. Any token is a valid draft, only likelier
                # to be rejected; the output stays exactly the model's.
                drafts += [drafts[-1] if drafts else st.token_ids[-1]] * (want - len(drafts))
        total = base + len(drafts)
        if end > total or end > len(st.block_ids) * bs or (drafts and start >= base):
            raise ValueError(f"sequence {st.seq_id!r}: {end} tokens exceed its tokens or blocks")
        starts[i] = start
        query_lens[i] = num_new
        rows[i] = st.row
        if num_new != 1:
            pure_decode = False
        input_ids.extend(st.token_ids[start : min(end, known)])
        if inflight and end > known:  # an input is the token the unfinished step samples
            from_device.append((len(input_ids), st.inflight_row))
            patch_seq = i
            input_ids.append(0)
        input_ids.extend(drafts)
        if end == total:
            sample_rows.append(i)
            verified.append(drafts)
            outputs_before.append(base - st.num_prompt_tokens)
    num_verified = sum(len(d) for d in verified)
    if num_verified:
        pure_decode = False
    seq_lens = starts + query_lens
    max_seq_len = int(seq_lens.max())
    width = min(round16((max_seq_len + bs - 1) // bs), table.shape[1])
    tables = table[rows, :width]  # fancy indexing: a fresh contiguous copy
    ids = np.asarray(input_ids, dtype=np.int64)
    if pure_decode:
        positions = starts
        token_rows = rows
    else:
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - qsl[:-1], query_lens)
        token_rows = np.repeat(rows, query_lens)
    slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
    if not pure_decode:
        last = qsl[1:][sample_rows] - 1 if sample_rows else np.zeros(0, dtype=np.int64)
        if num_verified:  # a verifying sequence samples at each draft's position too
            per_seq = np.asarray([len(d) + 1 for d in verified], dtype=np.int64)
            first = np.cumsum(per_seq) - per_seq
            offsets = np.arange(int(per_seq.sum()), dtype=np.int64) - np.repeat(first, per_seq)
            last = np.repeat(last + 1 - per_seq, per_seq) + offsets
    num_sampled = len(sample_rows)
    # A verification whose sequences all sample replays the verify graphs: token i of the
    # step becomes row to_padded[i] of q rows per sequence.
    vg = verify_graphs
    to_padded = None
    if num_verified and vg is not None and num_sampled == n and n <= vg.max_size:
        q = vg.q
        if int(query_lens.max()) <= q:
            # Context = seq_len - q: the rows past a sequence's end are padding.
            p_seq_lens = (starts + q).astype(np.int32)
            p_width = min(round16((int(p_seq_lens.max()) + bs - 1) // bs), table.shape[1])
            if p_width <= vg.width:
                grid = (np.arange(n, dtype=np.int64) * q)[:, None] + np.arange(q)[None, :]
                to_padded = grid[np.arange(q)[None, :] < query_lens[:, None]]
    moves = None
    patch_where = _NO_PATCH
    if from_device:
        moves = np.asarray(from_device, dtype=np.int64).T.copy()
        if to_padded is not None:
            moves[0] = to_padded[moves[0]]
        patch_where = moves[0]

    dg = decode_graphs
    if pure_decode and dg is not None and n <= dg.max_size and width <= dg.width:
        last_rows = None if num_sampled == n else np.asarray(sample_rows, dtype=np.int64)
        forward = ForwardInputs(
            DECODE_GRAPH, ids, positions, slots, seq_lens.astype(np.int32), tables, num_sampled,
            last_rows, patch_where=patch_where,
        )  # fmt: skip
    elif to_padded is not None:
        assert vg is not None
        q = vg.q
        p_ids = np.zeros(n * q, dtype=np.int64)
        p_ids[to_padded] = ids
        p_slots = np.full(n * q, -1, dtype=np.int64)  # padding rows write no KV
        p_slots[to_padded] = slots
        # Padding rows' positions only need to stay inside the rotary table.
        p_pos = np.minimum(starts[:, None] + np.arange(q)[None, :], max_model_len - 1).reshape(-1)
        forward = ForwardInputs(
            VERIFY_GRAPH, p_ids, p_pos, p_slots, p_seq_lens, table[rows, :p_width], num_sampled,
            to_padded[last], patch_where=patch_where,
        )  # fmt: skip
    else:
        if pure_decode:
            qsl = np.arange(n + 1, dtype=np.int64)
            last = qsl[1:][sample_rows] - 1 if sample_rows else np.zeros(0, dtype=np.int64)
        all_sample = pure_decode and num_sampled == n
        forward = ForwardInputs(
            EAGER, ids, positions, slots, seq_lens.astype(np.int32), tables, num_sampled,
            None if all_sample else last, qsl.astype(np.int32), query_lens, int(query_lens.max()),
            max_seq_len, patch_where,
        )  # fmt: skip
    return StepInputs(forward, sample_rows, verified, outputs_before, moves, patch_seq)
