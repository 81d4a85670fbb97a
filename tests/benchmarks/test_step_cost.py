"""The null worker's cost model (benchmarks/step_cost.py): the H100 figures it was fitted to."""

from __future__ import annotations

import pytest

from benchmarks.step_cost import COST_MODELS, H100_8B


def test_batch_1_decode_is_the_measured_6_ms() -> None:
    assert H100_8B.decode_seconds(1) == pytest.approx(6.05e-3, rel=0.02)
    assert H100_8B.seconds([], 1) == H100_8B.decode_seconds(1)
    assert H100_8B.seconds([], 0) == 0.0


@pytest.mark.parametrize(
    "tokens, measured",
    [(4096, 0.116), (32768, 1.60), (65536, 4.78), (120000, 13.77)],  # issue 31's prefill figures
)
def test_one_prompt_prefill_matches_the_measured_figures(tokens: int, measured: float) -> None:
    assert H100_8B.prefill_seconds([(0, tokens)]) == pytest.approx(measured, rel=0.03)


def test_short_prefill_is_about_28_us_per_token() -> None:
    per_token = H100_8B.prefill_seconds([(0, 4096)]) / 4096
    assert 25e-6 < per_token < 31e-6


def test_monotonic_in_tokens_context_and_batch() -> None:
    times = [H100_8B.prefill_seconds([(0, n)]) for n in (1, 16, 128, 1024, 4096, 16384)]
    assert times == sorted(times) and len(set(times)) == len(times)
    later = [H100_8B.prefill_seconds([(start, 512)]) for start in (0, 1024, 8192, 65536)]
    assert later == sorted(later) and len(set(later)) == len(later)
    steps = [H100_8B.decode_seconds(b) for b in (1, 2, 8, 64, 256, 1024)]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert H100_8B.decode_seconds(256) < 4 * H100_8B.decode_seconds(1)  # grows slowly with batch


def test_chunking_a_prompt_costs_the_same_attention() -> None:
    whole = H100_8B.prefill_seconds([(0, 8192)])
    chunks = H100_8B.seconds([(0, 2048)], 0) + H100_8B.seconds([(2048, 2048)], 0)
    chunks += H100_8B.seconds([(4096, 4096)], 0)
    assert chunks == pytest.approx(whole + 2 * H100_8B.a)  # one fixed cost per step


def test_uniform_workload_replays_to_the_measured_throughput() -> None:
    from benchmarks.step_cost import uniform_throughput

    tok_s, steps = uniform_throughput(H100_8B)
    assert tok_s == pytest.approx(8275, rel=0.1)  # docs/benchmarks.md, issue 29's run
    assert steps == pytest.approx(522, rel=0.1)


def test_none_means_no_model() -> None:
    assert COST_MODELS["none"] is None and COST_MODELS["h100-8b"] is H100_8B
