"""worker_svc/prompt_logprobs.py without a model: which rows of a forward predict prompt tokens
(across chunks and beside other sequences), and their values read back in slices of rows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from services.sampling_params import SamplingParams
from worker_svc import prompt_logprobs as plp


@dataclass
class Seq:
    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    params: SamplingParams


def test_rows_cover_each_prompt_position_once_across_chunks():
    want = SamplingParams(prompt_logprobs=2)
    a = Seq("a", list(range(10, 20)), 10, 0, want)  # 10 prompt tokens, chunks of 4, 4, 2
    b = Seq("b", [5, 6, 7], 3, 0, SamplingParams())  # asks for none
    rows = plp.prompt_rows([(b, 3), (a, 4)])
    assert rows is not None and rows.rows.tolist() == [3, 4, 5, 6]  # after b's 3 rows
    assert rows.targets == [11, 12, 13, 14] and rows.spans == [("a", 1, 4, 2)]
    a.num_computed_tokens = 4
    rows = plp.prompt_rows([(a, 4)])
    assert rows.targets == [15, 16, 17, 18] and rows.spans == [("a", 5, 4, 2)]
    a.num_computed_tokens = 8  # the last chunk: its last row is the sampled one, not a prompt row
    rows = plp.prompt_rows([(a, 2)])
    assert rows.rows.tolist() == [0] and rows.targets == [19] and rows.spans == [("a", 9, 1, 2)]
    a.num_computed_tokens = 10
    assert plp.prompt_rows([(a, 1)]) is None  # decoding: nothing of the prompt left


def test_values_in_slices_equal_one_log_softmax(monkeypatch):
    monkeypatch.setattr(plp, "_SLICE", 2)
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    rows = plp.PromptRows(rows=None, targets=[3, 7, 7, 40, 0], spans=[("x", 1, 3, 2), ("y", 4, 2, 0)])  # type: ignore[arg-type]
    out = plp.PromptLogprobsPending(logits, rows).wait()
    ref = torch.log_softmax(logits, dim=-1)
    entries = out[0].entries + out[1].entries
    assert [(c.seq_id, c.first, len(c.entries)) for c in out] == [("x", 1, 3), ("y", 4, 2)]
    for r, e in enumerate(entries):
        assert e.token_id == rows.targets[r]
        assert e.logprob == pytest.approx(ref[r, e.token_id].item(), abs=1e-6)
        assert e.rank == int((ref[r] > ref[r, e.token_id]).sum()) + 1
        k = 2 if r < 3 else 0
        top = torch.topk(ref[r], 2)
        assert e.top_token_ids == top.indices.tolist()[:k]
        assert e.top_logprobs == pytest.approx(top.values.tolist()[:k], abs=1e-6)
