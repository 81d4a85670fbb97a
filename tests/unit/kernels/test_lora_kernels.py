"""The batched LoRA kernels against their PyTorch twins (`kernels.lora_reference`), under the
interpreter: a batch mixing three adapter slots and base rows, merged segments (q|k|v-like)
of uneven widths, ranks below a tile, and slots without rows."""

from __future__ import annotations

import pytest
import torch

from kernels import lora_reference as ref
from kernels.triton import lora as kt


def _batch(slots: list[int], num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    slot_t = torch.tensor(slots)
    rows = [i for s in range(num_slots) for i in range(len(slots)) if slots[i] == s]
    counts = torch.bincount(slot_t[slot_t >= 0], minlength=num_slots)
    starts = torch.zeros(num_slots + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(counts, 0)
    return torch.tensor(rows, dtype=torch.int32), starts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_and_expand_match_twin(dtype: torch.dtype) -> None:
    slots = [0, -1, 2, 2, 0, -1, 2, 0, 0, 2, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0]  # slot 1 unused; 14 rows of 0
    num_slots, k, r = 3, 48, 8
    segs = [40, 24, 24]  # q | k | v, not multiples of the tile
    perm, starts = _batch(slots, num_slots)
    x = torch.randn(len(slots), k, dtype=dtype)
    a = (torch.randn(num_slots, len(segs) * r, k) / 4).to(dtype)
    b = (torch.randn(num_slots, sum(segs), r) / 4).to(dtype)
    seg_starts = torch.tensor([0, 40, 64, 88], dtype=torch.int32)
    y = kt.lora_shrink(x, a, perm, starts)
    y_ref = ref.lora_shrink(x, a, perm, starts)
    lora = perm.long()
    torch.testing.assert_close(y.sum(0)[lora], y_ref[0, lora], atol=1e-4, rtol=1e-4)
    base = torch.randn(len(slots), sum(segs), dtype=dtype)
    out = kt.lora_expand(y_ref, b, base.clone(), perm, starts, seg_starts, max_seg_n=40)
    out_ref = ref.lora_expand(y_ref, b, base.clone(), perm, starts, seg_starts)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, out_ref, atol=tol, rtol=tol)
    base_rows = torch.tensor([i for i, s in enumerate(slots) if s < 0])
    assert torch.equal(out[base_rows], base[base_rows])  # base rows untouched


def test_expand_adds_into_fp32_output_of_a_row_parallel_layer() -> None:
    slots = [1, 1, -1, 0]
    perm, starts = _batch(slots, 2)
    y = torch.randn(2, 4, 16)  # two planes of partial sums
    b = torch.randn(2, 20, 16, dtype=torch.bfloat16)
    out = torch.zeros(4, 20)
    seg_starts = torch.tensor([0, 20], dtype=torch.int32)
    got = kt.lora_expand(y, b, out.clone(), perm, starts, seg_starts)
    want = ref.lora_expand(y, b, out.clone(), perm, starts, seg_starts)
    # bf16 B: the interpreter rounds y to 16 bits its own way (see test_triton_kernels.py).
    torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)


def test_split_k_shrink_adds_its_partial_sums() -> None:
    slots = [0, 1, -1, 1, 0, 0]
    perm, starts = _batch(slots, 2)
    x = torch.randn(len(slots), 200)
    a = torch.randn(2, 24, 200) / 8
    lora = perm.long()
    want = ref.lora_shrink(x, a, perm, starts)[0, lora]
    for split_k in (2, 3):  # 4 tiles of 64 along K: some programs take two, some one
        y = kt.lora_shrink(x, a, perm, starts, split_k=split_k)
        assert y.shape[0] == split_k
        torch.testing.assert_close(y.sum(0)[lora], want, atol=1e-4, rtol=1e-4)
        # The expand sums the planes itself.
        b = torch.randn(2, 16, 8)
        seg = torch.tensor([0, 8, 16], dtype=torch.int32)
        out = kt.lora_expand(y, b, torch.zeros(len(slots), 16), perm, starts, seg)
        want_out = ref.lora_expand(
            ref.lora_shrink(x, a, perm, starts), b, torch.zeros(len(slots), 16), perm, starts, seg
        )
        torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)


def test_expand_blocks_that_mix_slots_and_a_given_shrink_output() -> None:
    """The expand's m-blocks are runs of `perm` whatever their slots: 16-row blocks over 5 slots
    of uneven counts (a slot ends mid-block, one spans blocks, one has no rows); the shrink
    writes the planes of a `y` handed to it (as the layer's side-stream shrink does)."""
    gen = torch.Generator().manual_seed(3)
    slots = torch.randint(-1, 5, (40,), generator=gen)
    slots[slots == 3] = 4  # slot 3 unused
    perm, starts = _batch(slots.tolist(), 5)
    x = torch.randn(40, 96, generator=gen)
    a = torch.randn(5, 2 * 8, 96, generator=gen) / 8
    b = torch.randn(5, 30, 8, generator=gen) / 4
    seg = torch.tensor([0, 18, 30], dtype=torch.int32)
    y = kt.lora_shrink(x, a, perm, starts, y=torch.full((2, 40, 16), float("nan")))
    assert y.shape[0] == 2
    base = torch.randn(40, 30, generator=gen)
    got = kt.lora_expand(y, b, base.clone(), perm, starts, seg, block_m=16, block_n=16)
    want = ref.lora_expand(ref.lora_shrink(x, a, perm, starts), b, base.clone(), perm, starts, seg)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[slots < 0], base[slots < 0])
