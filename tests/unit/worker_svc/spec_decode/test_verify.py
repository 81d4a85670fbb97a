"""Rejection sampling of draft tokens (`Sampler.verify_async`): the target distribution, exactly.

Thousands of sequences with the same logits rows and drafts go through one call, and the
tokens they produce are compared with what one-token-at-a-time sampling would give: the first
token follows p0 whatever the drafts; the token after an accepted draft follows p1; greedy
rows keep exactly the argmax path.
"""

from __future__ import annotations

import pytest
import torch

from services.sampling_params import SamplingParams
from tests.unit.worker_svc.test_sampler import chi_square
from worker_svc.sampler import Sampler, SamplingRow

CPU = torch.device("cpu")
VOCAB = 6


def rows_for(params: SamplingParams, num_out: int, num_drafts: int) -> list[SamplingRow]:
    return [SamplingRow(params, [], list(range(num_out + j)), []) for j in range(num_drafts + 1)]


def verify(sampler, logits_rows: torch.Tensor, drafts: list[int], n: int, **params):
    """n sequences, each with `logits_rows` (len(drafts)+1 rows) and the same drafts."""
    sp = SamplingParams(**params)
    logits = logits_rows.repeat(n, 1)
    rows = [r for _ in range(n) for r in rows_for(sp, 3, len(drafts))]
    out = sampler.verify_async(logits, rows, [list(drafts)] * n)
    ids, _ = out.wait()
    return ids, out.num_accepted


def tokens(ids, accepted, drafts):
    return [[*drafts[:a], t] for t, a in zip(ids, accepted, strict=True)]


P0 = torch.tensor([0.05, 0.4, 0.25, 0.15, 0.1, 0.05])
P1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.2, 0.1])
P2 = torch.tensor([0.1, 0.1, 0.5, 0.1, 0.1, 0.1])


def top_p_filtered(p: torch.Tensor, top_p: float) -> torch.Tensor:
    order = p.argsort()
    cum = p[order].cumsum(0)
    drop = cum <= 1 - top_p
    drop[-1] = False
    q = p.clone()
    q[order[drop]] = 0
    return q / q.sum()


@pytest.mark.parametrize("first_draft", [1, 4, 0])  # likely, unlikely, filtered out by top_p
def test_first_token_follows_the_target_whatever_the_draft(first_draft: int) -> None:
    sampler = Sampler(VOCAB, CPU, seed=1)
    logits = torch.stack([P0, P1, P2]).log()
    ids, acc = verify(sampler, logits, [first_draft, 3], 40_000, temperature=1.0, top_p=0.85)
    out = tokens(ids, acc, [first_draft, 3])
    # 5 dof at most: P(chi2 > 30) ~ 1.5e-5.
    assert chi_square([t[0] for t in out], top_p_filtered(P0, 0.85)) < 30
    # Given the first draft was accepted, the next token follows p1 (top_p applies there too).
    after = [t[1] for t in out if len(t) > 1 and t[0] == first_draft]
    if len(after) > 2000:
        assert chi_square(after, top_p_filtered(P1, 0.85)) < 30


def test_bonus_token_after_all_drafts_follows_the_last_row() -> None:
    sampler = Sampler(VOCAB, CPU, seed=2)
    certain = torch.full((VOCAB,), -30.0)
    certain[2] = 0.0  # the draft is (nearly) certain: accepted
    logits = torch.stack([certain, P2.log()])
    ids, acc = verify(sampler, logits, [2], 20_000, temperature=1.0)
    assert min(acc) == 1
    assert chi_square(ids, P2) < 30


def test_acceptance_rate_is_the_drafts_probability() -> None:
    sampler = Sampler(VOCAB, CPU, seed=3)
    ids, acc = verify(sampler, torch.stack([P0, P1]).log(), [2], 40_000, temperature=1.0)
    rate = sum(acc) / len(acc)
    assert abs(rate - 0.25) < 0.01


def test_greedy_accepts_exactly_the_argmax_path() -> None:
    sampler = Sampler(VOCAB, CPU, seed=4)
    logits = torch.stack([P0, P1, P2]).log()  # argmaxes 1, 0, 2
    for drafts, want in (([1, 0], [1, 0, 2]), ([1, 3], [1, 0]), ([5, 0], [1])):
        ids, acc = verify(sampler, logits, drafts, 3, temperature=0.0)
        assert tokens(ids, acc, drafts) == [want] * 3


def test_mixed_batch_of_drafting_and_plain_rows() -> None:
    sampler = Sampler(VOCAB, CPU, seed=5)
    g = SamplingParams(temperature=0.0)
    logits = torch.cat([torch.stack([P0, P1, P2]).log(), P1.log()[None], torch.stack([P2, P0]).log()])
    rows = rows_for(g, 0, 2) + rows_for(g, 0, 0) + rows_for(g, 5, 1)
    out = sampler.verify_async(logits, rows, [[1, 0], [], [2]])
    ids, _ = out.wait()
    assert (ids, out.num_accepted) == ([2, 0, 1], [2, 0, 1])
    assert out.sampled.tolist() == [2, 0, 1]  # the next step's inputs, on the device


def test_seeded_rows_verify_reproducibly() -> None:
    logits = torch.stack([P0, P1, P2]).log()
    results = []
    for sampler_seed in (10, 11):
        ids, acc = verify(Sampler(VOCAB, CPU, seed=sampler_seed), logits, [1, 3], 50, temperature=1.0, seed=7)
        results.append(tokens(ids, acc, [1, 3]))
    assert results[0] == results[1]  # the sampler's own seed does not matter to a seeded request
    assert len({tuple(t) for t in results[0]}) == 1  # same seed, same position: the same draw


def test_penalties_see_the_drafts_before_each_position() -> None:
    sampler = Sampler(VOCAB, CPU, seed=6)
    flat = torch.zeros(3, VOCAB)
    flat[:, 3] = 1.0  # token 3 leads everywhere, until a presence penalty pushes it down
    sp = SamplingParams(temperature=0.0, presence_penalty=2.0)
    rows = [SamplingRow(sp, [0], [1] + [3] * j, []) for j in range(3)]
    out = sampler.verify_async(flat, rows, [[3, 3]])
    ids, _ = out.wait()
    # Position 0 has not seen 3: accepted; position 1 has, so 3 is penalised there and rejected.
    assert out.num_accepted == [1]
    assert ids[0] != 3


def test_logprobs_with_drafts_are_refused() -> None:
    sampler = Sampler(VOCAB, CPU)
    sp = SamplingParams(temperature=0.0, logprobs=1)
    with pytest.raises(ValueError, match="logprobs"):
        sampler.verify_async(torch.zeros(2, VOCAB), rows_for(sp, 0, 1), [[1]])
