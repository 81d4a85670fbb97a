"""Sampler: filters, penalties, seeds and logprobs.

Statistical checks draw thousands of samples in one batched call (many rows sharing
one logits row) from a sampler with a fixed seed, so they are fast and deterministic;
the tolerances would hold for almost any seed anyway.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from services.sampling_params import SamplingParams
from worker_svc.sampler import Sampler, SamplingRow, seeded_draw_seed

CPU = torch.device("cpu")


def row(
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    eos: list[int] | None = None,
    **params: object,
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params),  # type: ignore[arg-type]
        prompt_token_ids=list(prompt or []),
        output_token_ids=list(output or []),
        eos_token_ids=list(eos or []),
    )


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def draw(sampler: Sampler, logits_row: torch.Tensor, n: int, **params: object) -> list[int]:
    """n independent draws: n rows sharing one logits row, in one call."""
    ids, _ = sampler.sample(logits_row.expand(n, -1).contiguous(), [row(**params) for _ in range(n)])
    return ids


def frequencies(ids: list[int], vocab: int) -> torch.Tensor:
    counts = Counter(ids)
    return torch.tensor([counts[t] for t in range(vocab)], dtype=torch.float64) / len(ids)


def chi_square(ids: list[int], expected: torch.Tensor) -> float:
    n = len(ids)
    observed = frequencies(ids, expected.numel()) * n
    exp = expected.double() * n
    keep = exp > 0
    assert observed[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((observed[keep] - exp[keep]) ** 2 / exp[keep]).sum())


# -- greedy -------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    ids, lps = Sampler(100, CPU, seed=0).sample(logits, [row(temperature=0.0) for _ in range(16)])
    assert ids == logits.argmax(-1).tolist()
    assert lps == [None] * 16


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 50)
    rows = [row(temperature=0.0) if i % 2 else row(temperature=1.0, top_k=5) for i in range(8)]
    ids, _ = Sampler(50, CPU, seed=0).sample(logits, rows)
    argmax = logits.argmax(-1).tolist()
    for i in range(1, 8, 2):
        assert ids[i] == argmax[i]
    for i in range(0, 8, 2):
        assert ids[i] in logits[i].topk(5).indices.tolist()


def test_input_logits_untouched_and_empty_batch() -> None:
    sampler = Sampler(10, CPU, seed=0)
    logits = torch.randn(2, 10)
    before = logits.clone()
    sampler.sample(
        logits,
        [
            row(
                output=[1, 1], prompt=[2], repetition_penalty=1.5, presence_penalty=1.0, min_tokens=5, eos=[3]
            ),
            row(temperature=0.7, top_k=3, top_p=0.9, min_p=0.1),
        ],
    )
    assert torch.equal(logits, before)
    assert sampler.sample(torch.empty(0, 10), []) == ([], [])


def test_padded_vocab_columns_are_never_sampled() -> None:
    # lm_head padded to 16 columns for a 10-token vocab; padding gets huge logits.
    logits = torch.zeros(64, 16)
    logits[:, 10:] = 100.0
    sampler = Sampler(10, CPU, seed=0)
    ids, _ = sampler.sample(logits, [row(temperature=0.0)] + [row() for _ in range(63)])
    assert max(ids) < 10


def test_bf16_logits_are_accepted() -> None:
    logits = torch.randn(4, 32).to(torch.bfloat16)
    ids, lps = Sampler(32, CPU, seed=0).sample(logits, [row(temperature=0.0, logprobs=2)] * 4)
    assert ids == logits.float().argmax(-1).tolist()
    assert lps[0] is not None and lps[0].rank == 1


# -- distribution and filters ---------------------------------------------------


def test_plain_sampling_matches_softmax() -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    ids = draw(Sampler(6, CPU, seed=0), probs.log(), 20_000)
    # 5 degrees of freedom: P(chi2 > 30) ~ 1.5e-5.
    assert chi_square(ids, probs) < 30


# top_k alone runs through torch.topk; with top_p (or a huge k) through one full sort.
TOPK_PATHS = pytest.mark.parametrize("topk_path", [True, False], ids=["topk", "sort"])


def sampler_for(vocab: int, topk_path: bool) -> Sampler:
    sampler = Sampler(vocab, CPU, seed=0)
    if not topk_path:
        sampler.TOPK_PATH_MAX_K = 0
    return sampler


@TOPK_PATHS
def test_top_k_never_leaves_the_top_k(topk_path: bool) -> None:
    torch.manual_seed(2)
    logits = torch.randn(40)
    allowed = set(logits.topk(3).indices.tolist())
    ids = draw(sampler_for(40, topk_path), logits, 5000, top_k=3, temperature=2.0)
    assert set(ids) == allowed  # never outside, and every one of the 3 is reachable


@TOPK_PATHS
def test_top_k_keeps_exactly_k_on_ties(topk_path: bool) -> None:
    logits = torch.zeros(10)  # all tied
    ids = draw(sampler_for(10, topk_path), logits, 4000, top_k=4)
    assert len(set(ids)) == 4


def test_top_k_larger_than_vocab_is_no_filter() -> None:
    probs = torch.full((5,), 0.2)
    ids = draw(Sampler(5, CPU, seed=0), probs.log(), 2000, top_k=1000)
    assert set(ids) == set(range(5))


def test_top_p_keeps_the_nucleus_and_renormalises() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    sampler = Sampler(4, CPU, seed=0)
    # p=0.75: 0.5 < 0.75 <= 0.8, so the nucleus is {1, 3}.
    ids = draw(sampler, probs.log(), 8000, top_p=0.75)
    assert set(ids) == {1, 3}
    assert chi_square(ids, torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8) < 20
    # p=0.85: 0.8 < 0.85 <= 0.95, so {1, 3, 2}.
    assert set(draw(sampler, probs.log(), 8000, top_p=0.85)) == {1, 2, 3}
    # A tiny p keeps only the most likely token.
    assert set(draw(sampler, probs.log(), 500, top_p=1e-3)) == {1}


@pytest.mark.parametrize(
    "params", [dict(top_p=0.8), dict(top_p=0.6, temperature=0.7), dict(top_k=5, top_p=0.7)]
)
def test_the_nucleus_search_gives_the_sorts_distribution(params: dict) -> None:
    """Large batches on CUDA take top_p through the search kernel (here under the interpreter):
    the same distribution as the sort's, for logits without ties."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(7)) * 2
    rows = [row(**params) for _ in range(6)]
    by_sort = Sampler(40, CPU, seed=0).filtered_probs(logits.clone(), rows)
    searching = Sampler(40, CPU, seed=0)
    searching.NUCLEUS_SEARCH_ON_CPU, searching.NUCLEUS_SEARCH_MIN_ROWS = True, 1
    by_search = searching.filtered_probs(logits.clone(), rows)
    torch.testing.assert_close(by_search, by_sort)
    assert ((by_sort > 0).sum(-1) < 40).all()  # the filter did drop tokens


def test_top_p_applies_after_top_k() -> None:
    # After top_k=3 the distribution is [0.4, 0.3, 0.2] / 0.9 = [.444, .333, .222], so p=0.76
    # keeps {0, 1} (.444 < .76 <= .778). Top_p over the raw distribution would keep {0, 1, 2}.
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    ids = draw(Sampler(4, CPU, seed=0), probs.log(), 4000, top_k=3, top_p=0.76)
    assert set(ids) == {0, 1}


def test_min_p_drops_tokens_below_min_p_times_max() -> None:
    probs = torch.tensor([0.02, 0.4, 0.08, 0.3, 0.2])
    # threshold 0.25 * 0.4 = 0.1: keeps 0.4, 0.3, 0.2.
    ids = draw(Sampler(5, CPU, seed=0), probs.log(), 6000, min_p=0.25)
    assert set(ids) == {1, 3, 4}
    assert chi_square(ids, torch.tensor([0.0, 0.4, 0.0, 0.3, 0.2]) / 0.9) < 20


def test_min_p_is_relative_to_the_distribution_after_temperature() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.08, 0.02])
    # T=0.5 squares the probabilities: ratios to the max become [1, .5625, .25, .04, .0025],
    # so min_p=0.3 keeps {0, 1} (at T=1 the ratios [1, .75, .5, ...] would keep {0, 1, 2}).
    ids = draw(Sampler(5, CPU, seed=0), probs.log(), 6000, min_p=0.3, temperature=0.5)
    assert set(ids) == {0, 1}


def test_low_temperature_is_near_greedy() -> None:
    logits = torch.tensor([1.0, 2.0, 0.0, 1.5])
    ids = draw(Sampler(4, CPU, seed=0), logits, 5000, temperature=0.02)  # gap 0.5 / 0.02 = 25 nats
    assert set(ids) == {1}


def test_temperature_scales_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    sampler = Sampler(5, CPU, seed=0)
    top_share = {}
    for temp in (0.5, 1.0, 1.8):
        ids = draw(sampler, logits, 20_000, temperature=temp)
        assert chi_square(ids, torch.softmax(logits / temp, -1)) < 30  # 4 dof: P ~ 3e-6
        top_share[temp] = Counter(ids)[0] / len(ids)
    assert top_share[0.5] > top_share[1.0] > top_share[1.8]


@TOPK_PATHS
def test_filters_combine_per_row(topk_path: bool) -> None:
    # One batch, one logits row, each sample row with its own filter: rows must not leak.
    torch.manual_seed(3)
    logits = torch.randn(30)
    sampler = sampler_for(30, topk_path)
    n = 1500
    rows = [row(top_k=2) for _ in range(n)] + [row() for _ in range(n)] + [row(temperature=0.0)] * 3
    ids, _ = sampler.sample(logits.expand(len(rows), -1).contiguous(), rows)
    assert set(ids[:n]) == set(logits.topk(2).indices.tolist())
    assert len(set(ids[n : 2 * n])) > 10
    assert set(ids[2 * n :]) == {int(logits.argmax())}


# -- penalties and min_tokens ----------------------------------------------------


def test_repetition_and_presence_frequency_exact_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    r = row(
        prompt=[0, 4],
        output=[1, 1, 3],
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        temperature=0.0,
    )
    out = Sampler(6, CPU).process_logits(logits, [r])
    # Repetition (prompt + output = {0, 1, 3, 4}): positive / 2, negative * 2.
    #   0: 2 -> 1;  1: -1 -> -2;  3: 3 -> 1.5;  4: -2 -> -4;  2, 5 untouched.
    # Presence 0.5 + frequency 0.25 * count over output only ({1: 2, 3: 1}):
    #   1: -2 - 0.5 - 0.5 = -3;  3: 1.5 - 0.5 - 0.25 = 0.75.
    assert out.tolist() == [[1.0, -3.0, 0.5, 0.75, -4.0, 0.0]]


def test_penalties_are_per_row_and_optional() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]] * 3)
    rows = [
        row(output=[2], repetition_penalty=1.5),
        row(output=[2]),  # no penalty: untouched
        row(output=[2, 2], frequency_penalty=-1.0),  # negative penalty encourages repeats
    ]
    out = Sampler(3, CPU).process_logits(logits, rows)
    assert out.tolist() == [[1.0, 2.0, 2.0], [1.0, 2.0, 3.0], [1.0, 2.0, 5.0]]


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    sampler = Sampler(3, CPU)
    assert sampler.sample(logits, [row(temperature=0.0, prompt=[0])])[0] == [0]
    assert sampler.sample(logits, [row(temperature=0.0, prompt=[0], repetition_penalty=2.0)])[0] == [1]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])  # EOS = 2 is the argmax, stop id 3 next
    sampler = Sampler(5, CPU)
    kw = dict(temperature=0.0, min_tokens=3, stop_token_ids=[3], eos=[2])
    assert sampler.sample(logits, [row(output=[0, 0], **kw)])[0] == [4]
    assert sampler.sample(logits, [row(output=[0, 0, 0], **kw)])[0] == [2]
    # ignore_eos: EOS is an ordinary token (not masked), stop ids are still held back.
    assert sampler.sample(logits, [row(output=[], ignore_eos=True, **kw)])[0] == [2]
    out = sampler.process_logits(logits, [row(output=[1], ignore_eos=True, **kw)])
    assert out[0, 3] == -math.inf and out[0, 2] == 5.0
    # Sampled rows never draw a masked token either.
    many = draw(
        sampler, torch.tensor([0.0, 0.0, 3.0, 3.0, 0.0]), 2000, min_tokens=1, stop_token_ids=[3], eos=[2]
    )
    assert not {2, 3} & set(many)


def test_min_tokens_ignores_ids_outside_the_vocab() -> None:
    ids, _ = Sampler(4, CPU).sample(
        torch.tensor([[0.0, 1.0, 2.0, 3.0]]),
        [row(temperature=0.0, min_tokens=2, stop_token_ids=[10**6], eos=[3])],
    )
    assert ids == [2]


# -- seeds ------------------------------------------------------------------------


def seeded_run(sampler: Sampler, seed: int, steps: int, others: int = 0, position: int = 0) -> list[int]:
    """Generate `steps` tokens for one seeded row amid `others` noise rows, from flat logits."""
    vocab = sampler.vocab_size
    out: list[int] = []
    for _ in range(steps):
        rows = [row(output=[7] * k, temperature=0.9 + 0.01 * k) for k in range(others)]
        if others:
            rows[0] = row(temperature=0.0)  # a greedy row, too
        rows.insert(position, row(output=list(out), seed=seed, top_k=vocab // 2))
        logits = torch.zeros(len(rows), vocab)
        logits[:, 0] = 0.01  # so top_k has a well-defined half
        ids, _ = sampler.sample(logits, rows)
        out.append(ids[position])
    return out


def test_seeded_rows_repeat_regardless_of_batch_and_position() -> None:
    alone = seeded_run(Sampler(1000, CPU, seed=1), seed=42, steps=12)
    assert len(set(alone)) > 8  # successive tokens are drawn differently
    # Another sampler (another process, other state), other batch mates, another row position.
    assert seeded_run(Sampler(1000, CPU, seed=2), seed=42, steps=12, others=5, position=3) == alone
    assert seeded_run(Sampler(1000, CPU), seed=42, steps=12, others=2, position=2) == alone
    assert seeded_run(Sampler(1000, CPU, seed=1), seed=43, steps=12) != alone


def test_seeded_row_resumes_after_preemption() -> None:
    full = seeded_run(Sampler(500, CPU, seed=0), seed=-7, steps=10)
    # Recompute after preemption, in a fresh sampler (another process): the scheduler sends the
    # 6 tokens generated so far as output, and tokens 7..10 come out the same.
    sampler = Sampler(500, CPU, seed=99)
    again = []
    for k in range(6, 10):
        logits = torch.zeros(1, 500)
        logits[:, 0] = 0.01  # the same logits as seeded_run
        ids, _ = sampler.sample(logits, [row(output=full[:k], seed=-7, top_k=250)])
        again.append(ids[0])
    assert again == full[6:]


def test_seed_hash_is_stable() -> None:
    # Pinned: changing the hash silently breaks reproducibility of seeded requests across versions.
    assert seeded_draw_seed(0, 0) == seeded_draw_seed(0, 0)
    assert seeded_draw_seed(0, 0) != seeded_draw_seed(0, 1) != seeded_draw_seed(1, 1)
    assert 0 <= seeded_draw_seed(-(2**63), 10**6) < 2**63
    assert seeded_draw_seed(42, 3) == 6837007169329555547


def test_unseeded_rows_differ_across_draws_and_sampler_seed_reproduces() -> None:
    logits = torch.zeros(1, 1000)
    a = Sampler(1000, CPU, seed=5)
    seq = [a.sample(logits, [row()])[0][0] for _ in range(20)]
    assert len(set(seq)) > 15
    # Rows of one batch differ too.
    assert len(set(draw(a, logits[0], 20))) > 15
    b = Sampler(1000, CPU, seed=5)
    assert [b.sample(logits, [row()])[0][0] for _ in range(20)] == seq
    c = Sampler(1000, CPU)  # nondeterministic seed
    assert [c.sample(logits, [row()])[0][0] for _ in range(20)] != seq


# -- logprobs ---------------------------------------------------------------------


def test_logprobs_match_log_softmax_and_ranks() -> None:
    torch.manual_seed(4)
    vocab = 50
    logits = torch.randn(5, vocab) * 3
    rows = [
        row(temperature=0.0, logprobs=5),
        row(logprobs=0),
        row(),  # no logprobs
        row(logprobs=20, temperature=1.5, top_k=10, repetition_penalty=1.7, output=[1, 2], prompt=[3]),
        row(logprobs=3, seed=1),
    ]
    ids, lps = Sampler(vocab, CPU, seed=0).sample(logits, rows)
    ref = torch.log_softmax(logits, -1)  # raw: before penalties, temperature and filters
    assert lps[2] is None
    for i, r in enumerate(rows):
        lp = lps[i]
        if lp is None:
            continue
        k = r.params.logprobs
        assert lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(ref[i, ids[i]].item(), abs=1e-6)
        order = ref[i].argsort(descending=True).tolist()
        assert lp.rank == order.index(ids[i]) + 1
        assert lp.top_token_ids == order[:k]
        assert lp.top_logprobs == pytest.approx(ref[i, order[:k]].tolist(), abs=1e-6)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    assert lps[0].rank == 1  # greedy
    assert lps[1].top_token_ids == [] and lps[1].top_logprobs == []


def test_logprob_rank_of_a_low_token() -> None:
    # min_tokens forces the 3rd most likely token under greedy; its raw rank is 3.
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]])
    r = row(temperature=0.0, logprobs=2, min_tokens=1, eos=[0], stop_token_ids=[1])
    ids, lps = Sampler(4, CPU).sample(logits, [r])
    assert ids == [2]
    assert lps[0] is not None
    assert lps[0].rank == 3
    assert lps[0].top_token_ids == [0, 1]
    assert lps[0].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())


# -- CUDA: one device->host copy per step ------------------------------------------


def count_syncs(fn: Callable[[], object]) -> tuple[int, object]:
    """(synchronizing CUDA operations fn ran, what fn returned); fn runs once before, to warm up."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught), out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_single_sync_and_seed_reproducibility() -> None:
    dev = torch.device("cuda")
    vocab = 1000
    sampler = Sampler(vocab, dev, seed=0)
    logits = torch.randn(6, vocab, device=dev)
    rows = [
        row(temperature=0.0, logprobs=3),
        row(top_k=20, top_p=0.9, min_p=0.05, temperature=0.8, output=[1, 2], prompt=[5]),
        row(seed=11, output=[3], repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
        row(logprobs=0, min_tokens=4, eos=[7], stop_token_ids=[9]),
        row(seed=12, logprobs=5),
        row(),
    ]
    syncs, (ids, lps) = count_syncs(lambda: sampler.sample(logits, rows))  # type: ignore[misc]
    assert syncs == 0  # the results reach the host through a kernel's stores and an event
    assert ids[0] == int(logits[0].argmax())
    assert lps[0] is not None and lps[0].rank == 1
    # The top_k-only path, greedy-only and sampled-only batches do not either.
    for batch in (
        [row(top_k=5), row(top_k=0, presence_penalty=1.0, output=[4]), row(temperature=0.0)],
        [row(temperature=0.0, repetition_penalty=1.3, prompt=[1, 2])] * 3,
        [row(temperature=0.5, seed=1), row(min_p=0.2), row(logprobs=2)],
    ):
        assert count_syncs(lambda b=batch: sampler.sample(logits[:3], b))[0] == 0
    # Seeded row reproduces on the device too, alone and in another position.
    alone, _ = Sampler(vocab, dev, seed=3).sample(logits[2:3], [rows[2]])
    moved, _ = Sampler(vocab, dev, seed=4).sample(logits[[5, 2]], [rows[5], rows[2]])
    assert alone[0] == ids[2] == moved[1]


def test_untouched_greedy_rows_take_the_argmax_of_the_model_dtype() -> None:
    """bf16 logits with a padded column: greedy rows with nothing to process skip the fp32 copy
    and get the argmax of the vocabulary's columns (the copy's argmax); a penalty still applies."""
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(4, vocab + 6).to(torch.bfloat16)
    logits[:, vocab:] = 100.0  # padding columns: never sampled
    sampler = Sampler(vocab, CPU, seed=0)
    plain = [row(output=[1], temperature=0.0) for _ in range(4)]
    assert sampler._untouched_greedy(plain)
    ids, _ = sampler.sample_async(logits, plain).wait()
    assert ids == logits[:, :vocab].float().argmax(dim=-1).tolist()
    logits[0, :vocab] = -10.0
    logits[0, 3], logits[0, 7] = 1.0, 0.5
    penalised = [row(output=[3], temperature=0.0, frequency_penalty=2.0)] + plain[1:]
    assert not sampler._untouched_greedy(penalised)
    assert sampler.sample_async(logits, penalised).wait()[0][0] == 7
    assert not sampler._untouched_greedy([row(output=[], temperature=0.0, min_tokens=1)])
