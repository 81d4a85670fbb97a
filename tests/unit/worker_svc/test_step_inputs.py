"""A step's host inputs (`worker_svc.step_inputs.prepare_step`): numpy only, no model, no device.

Block size 4 throughout; each sequence's row of the block table holds its block ids, so a
slot is block_id * 4 + position % 4.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from worker_svc.rank_channel import DECODE_GRAPH, EAGER, VERIFY_GRAPH
from worker_svc.step_inputs import BlockTableRows, prepare_step

BS = 4
MAX_LEN = 64


@dataclass
class Seq:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int = 0
    seq_id: str = "s"
    row: int = -1
    inflight: object | None = None
    inflight_row: int = -1
    drafts: list[int] = field(default_factory=list)
    draft_start: int = 0


@dataclass
class Graphs:
    max_size: int = 4
    width: int = 16
    q: int = 1


def _table(*seqs: Seq) -> BlockTableRows:
    tables = BlockTableRows(16, rows=4)
    for st in seqs:
        st.row = tables.alloc(st.block_ids)
    return tables


def test_pure_decode_replays_the_decode_graph_and_samples_every_row() -> None:
    a = Seq(list(range(10, 16)), [7, 3], num_computed_tokens=5, num_prompt_tokens=4)
    b = Seq([1, 2, 3], [9], num_computed_tokens=2, num_prompt_tokens=3)
    t = _table(a, b)
    step = prepare_step([(a, 1), (b, 1)], t.table, BS, MAX_LEN, Graphs())
    f = step.forward
    assert f.mode == DECODE_GRAPH and f.num_sampled == 2 and f.sample_index is None
    assert f.ids.tolist() == [15, 3]
    assert f.positions.tolist() == [5, 2]
    assert f.slots.tolist() == [3 * 4 + 1, 9 * 4 + 2]
    assert f.seq_lens.dtype == np.int32 and f.seq_lens.tolist() == [6, 3]
    assert f.tables.shape == (2, 16) and f.tables[0, :2].tolist() == [7, 3]
    assert step.sample_seqs == [0, 1] and step.verified == [[], []] and step.outputs_before == [2, 0]
    assert step.patch_moves is None and f.patch_where.size == 0


def test_pure_decode_without_graphs_runs_eagerly_with_decode_offsets() -> None:
    a = Seq([1, 2, 3], [9], num_computed_tokens=2)
    t = _table(a)
    f = prepare_step([(a, 1)], t.table, BS, MAX_LEN).forward
    assert f.mode == EAGER and f.sample_index is None  # every row samples
    assert f.query_start_loc.dtype == np.int32 and f.query_start_loc.tolist() == [0, 1]
    assert (f.max_query_len, f.max_seq_len) == (1, 3)


def test_a_batch_wider_than_the_graphs_runs_eagerly() -> None:
    a = Seq([1, 2, 3], [9], num_computed_tokens=2)
    t = _table(a)
    assert prepare_step([(a, 1)], t.table, BS, MAX_LEN, Graphs(max_size=0)).forward.mode == EAGER


def test_mixed_prefill_chunk_and_decode() -> None:
    # a: a 6-token prompt prefilled in chunks, 4 now (not its end: it does not sample).
    a = Seq(list(range(20, 26)), [5, 6], num_computed_tokens=0, num_prompt_tokens=6)
    # b: its last 2 prompt tokens, which ends it (it samples).
    b = Seq([1, 2, 3, 4, 5], [8, 2], num_computed_tokens=3, num_prompt_tokens=5)
    c = Seq([7, 8, 9], [4], num_computed_tokens=2, num_prompt_tokens=2)  # a decode
    t = _table(a, b, c)
    step = prepare_step([(a, 4), (b, 2), (c, 1)], t.table, BS, MAX_LEN, Graphs(), Graphs(q=4))
    f = step.forward
    assert f.mode == EAGER
    assert f.ids.tolist() == [20, 21, 22, 23, 4, 5, 9]
    assert f.positions.tolist() == [0, 1, 2, 3, 3, 4, 2]
    assert f.slots.tolist() == [20, 21, 22, 23, 8 * 4 + 3, 2 * 4 + 0, 4 * 4 + 2]
    assert f.query_start_loc.tolist() == [0, 4, 6, 7]
    assert f.query_lens.tolist() == [4, 2, 1] and f.seq_lens.tolist() == [4, 5, 3]
    assert (f.max_query_len, f.max_seq_len) == (4, 5)
    assert step.sample_seqs == [1, 2] and f.num_sampled == 2
    assert f.sample_index is not None and f.sample_index.tolist() == [5, 6]  # each one's last token


def test_a_token_still_on_the_device_is_a_placeholder_patched_from_its_row() -> None:
    a = Seq([1, 2, 3], [9], num_computed_tokens=3, inflight=object(), inflight_row=1)
    b = Seq([4, 5], [2], num_computed_tokens=1)
    t = _table(a, b)
    step = prepare_step([(a, 1), (b, 1)], t.table, BS, MAX_LEN, Graphs())
    f = step.forward
    assert f.mode == DECODE_GRAPH and f.ids.tolist() == [0, 5]
    assert f.positions.tolist() == [3, 1]
    assert step.patch_moves is not None and step.patch_moves.tolist() == [[0], [1]]
    assert f.patch_where.tolist() == [0] and step.patch_seq == 0
    assert step.outputs_before == [4, 2]  # the token in flight counts


def test_verification_of_drafts_samples_at_every_draft() -> None:
    a = Seq([1, 2, 3, 4], [9, 3], num_computed_tokens=3, num_prompt_tokens=2, drafts=[50, 51, 52])
    a.draft_start = 4
    b = Seq([6, 7], [5], num_computed_tokens=1, num_prompt_tokens=1)  # a plain decode beside it
    t = _table(a, b)
    step = prepare_step([(a, 3), (b, 1)], t.table, BS, MAX_LEN, Graphs())  # no verify graphs
    f = step.forward
    assert f.mode == EAGER
    assert f.ids.tolist() == [4, 50, 51, 7]
    assert f.positions.tolist() == [3, 4, 5, 1]
    assert step.verified == [[50, 51], []] and step.num_verified == 2
    assert f.sample_index is not None and f.sample_index.tolist() == [0, 1, 2, 3]


def test_verification_fills_up_drafts_that_a_later_proposal_replaced() -> None:
    a = Seq([1, 2, 3, 4], [9, 3], num_computed_tokens=3, drafts=[50], draft_start=4)
    t = _table(a)
    step = prepare_step([(a, 3)], t.table, BS, MAX_LEN)
    assert step.verified == [[50, 50]] and step.forward.ids.tolist() == [4, 50, 50]
    assert a.drafts == [50]  # the sequence's own drafts are left as they are


def test_verify_graph_pads_each_sequence_to_q_rows() -> None:
    a = Seq([1, 2, 3, 4], [9, 3], num_computed_tokens=3, drafts=[50, 51], draft_start=4)
    b = Seq([6, 7], [5], num_computed_tokens=1)
    t = _table(a, b)
    step = prepare_step([(a, 3), (b, 1)], t.table, BS, MAX_LEN, Graphs(), Graphs(q=3))
    f = step.forward
    assert f.mode == VERIFY_GRAPH
    # a's 3 rows, then b's one token and 2 padding rows (slot -1, position clamped in range).
    assert f.ids.tolist() == [4, 50, 51, 7, 0, 0]
    assert f.slots.tolist() == [9 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1, 5 * 4 + 1, -1, -1]
    assert f.positions.tolist() == [3, 4, 5, 1, 2, 3]
    assert f.seq_lens.dtype == np.int32 and f.seq_lens.tolist() == [6, 4]  # context = seq_len - q
    assert f.sample_index is not None and f.sample_index.tolist() == [0, 1, 2, 3]
    assert step.patch_moves is None


def test_verify_graph_maps_a_patched_token_to_its_padded_row() -> None:
    a = Seq([1, 2], [9], num_computed_tokens=1, drafts=[50], draft_start=2)
    # b's last token is on the device (the step in flight samples it): its draft follows it.
    b = Seq([6, 7], [5], num_computed_tokens=2, inflight=object(), inflight_row=4, drafts=[60])
    b.draft_start = 3
    t = _table(a, b)
    step = prepare_step([(a, 2), (b, 2)], t.table, BS, MAX_LEN, None, Graphs(q=3))
    f = step.forward
    assert f.mode == VERIFY_GRAPH
    assert f.ids.tolist() == [2, 50, 0, 0, 60, 0]  # b's first input is on the device
    assert step.patch_moves is not None and step.patch_moves.tolist() == [[3], [4]]
    assert step.verified == [[50], [60]]


def test_tokens_past_a_sequences_blocks_are_refused() -> None:
    a = Seq(list(range(6)), [9], num_computed_tokens=0)
    t = _table(a)
    with pytest.raises(ValueError, match="exceed its tokens or blocks"):
        prepare_step([(a, 6)], t.table, BS, MAX_LEN)
