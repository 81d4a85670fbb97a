"""LoRA A/B split across tensor-parallel ranks as the base layers are: each rank's low-rank delta
(computed by the twin kernels from its slot) is its part of the full delta, i.e. its output rows
of every segment on a column-parallel layer, a partial sum over its input columns on a
row-parallel one."""

from __future__ import annotations

import torch

from worker_svc.lora.layer import BatchRef, LoRABatch, LoRALayer
from worker_svc.models.parallel_layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from worker_svc.parallel import TensorParallel

HIDDEN, Q, KV, INTER, R = 32, 32, 16, 48, 4


def _delta(layer: LoRALayer, x: torch.Tensor) -> torch.Tensor:
    """What the hook adds for rows all of slot 0."""
    n = x.shape[0]
    layer.ref.batch = LoRABatch(
        torch.arange(n, dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), n
    )
    out = torch.zeros(n, layer.b.shape[1])
    return layer(x, out)


def _ranks(make, size: int = 2) -> list[LoRALayer]:
    return [
        LoRALayer(make(TensorParallel(rank=r, size=size)), 1, 8, torch.float32, BatchRef())
        for r in range(size)
    ]


def test_column_parallel_ranks_hold_their_rows_of_each_segment() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, HIDDEN)
    ab = {s: (torch.randn(R, HIDDEN), torch.randn(n, R)) for s, n in (("q", Q), ("k", KV), ("v", KV))}
    full = {s: x @ a.T @ b.T * 2.0 for s, (a, b) in ab.items()}
    ranks = _ranks(lambda tp: QKVParallelLinear(HIDDEN, Q, KV, False, tp))
    for rank, layer in enumerate(ranks):
        for s, (a, b) in ab.items():
            layer.load(0, s, a, b, 2.0)
        got = _delta(layer, x)
        want = torch.cat([full[s].chunk(2, dim=1)[rank] for s in ("q", "k", "v")], dim=1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_missing_segment_adds_nothing_there() -> None:
    x = torch.randn(3, HIDDEN)
    (layer,) = _ranks(lambda tp: MergedColumnParallelLinear(HIDDEN, INTER, False, tp), size=1)
    a, b = torch.randn(R, HIDDEN), torch.randn(INTER, R)
    layer.load(0, "up", a, b, 0.5)
    got = _delta(layer, x)
    assert torch.equal(got[:, :INTER], torch.zeros(3, INTER))
    torch.testing.assert_close(got[:, INTER:], x @ a.T @ b.T * 0.5, atol=1e-5, rtol=1e-5)


def test_row_parallel_ranks_sum_to_the_full_delta() -> None:
    x = torch.randn(4, INTER)
    a, b = torch.randn(R, INTER), torch.randn(HIDDEN, R)
    ranks = _ranks(lambda tp: RowParallelLinear(INTER, HIDDEN, False, tp))
    partial = []
    for rank, layer in enumerate(ranks):
        layer.load(0, None, a, b, 1.5)
        partial.append(_delta(layer, x.chunk(2, dim=1)[rank]))  # each rank sees its input columns
    torch.testing.assert_close(sum(partial), x @ a.T @ b.T * 1.5, atol=1e-4, rtol=1e-4)
