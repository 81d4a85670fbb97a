"""Decode graph sizes: doubling while the padding rows cost nothing (weight-bound batches), then
steps of 32 and 64 rows, where each padding row costs GEMM work; the maximum always included."""

from __future__ import annotations

from worker_svc.cuda_graphs import capture_sizes


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 224, 256]
    big = capture_sizes(1024)
    assert big[:8] == [1, 2, 4, 8, 16, 32, 64, 128] and big[-1] == 1024 and len(big) == 28
    steps = [b - a for a, b in zip(big[7:-1], big[8:], strict=True)]
    assert set(steps[:12]) == {32} and set(steps[12:]) == {64}
    # a batch pads by at most an eighth of itself past 128 rows (a quarter at 129)
    assert all((b - a) / a <= 0.25 for a, b in zip(big[7:-1], big[8:], strict=True))
