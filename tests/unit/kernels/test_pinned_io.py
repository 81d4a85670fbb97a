"""The host-memory kernels against their torch twins (interpreter on CPU; page-locked host
memory on CUDA)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton.pinned_io import copy_to_host, fill_decode_inputs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _host(t: torch.Tensor, device: str) -> torch.Tensor:
    return t.pin_memory() if device == "cuda" else t


def _buffers(device: str, b_max: int = 8, width: int = 40) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Static buffers holding stale values, as a decode graph's do between steps."""
    i64 = torch.full((3, b_max), -7, dtype=torch.int64, device=device)
    lens = torch.full((b_max,), -7, dtype=torch.int32, device=device)
    tables = torch.full((b_max, width), -7, dtype=torch.int32, device=device)
    return i64, lens, tables


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b, w, patched", [(1, 3, False), (3, 17, True), (8, 40, True)])
def test_fill_decode_inputs_matches_twin(device: str, b: int, w: int, patched: bool) -> None:
    g = torch.Generator().manual_seed(b * 100 + w)
    rows = b + 1 if b < 8 else b  # a padding row past the sequences, as q rows make
    src_i64 = _host(torch.randint(0, 1000, (3, rows), generator=g), device)
    src_i32 = _host(torch.randint(0, 1000, (b + b * w,), generator=g, dtype=torch.int32), device)
    patch = None
    if patched:  # the last sequence's id and the first's, from a step still on the device
        moves = _host(torch.tensor([[b - 1, 0], [2, 0]], dtype=torch.int64), device)
        patch = (moves, torch.tensor([31337, 7, 424242], dtype=torch.int32, device=device))
    got, want = _buffers(device), _buffers("cpu")
    fill_decode_inputs(*got, src_i64, src_i32, b, w, patch)
    cpu_patch = None if patch is None else (patch[0].cpu(), patch[1].cpu())
    reference.fill_decode_inputs(*want, src_i64.cpu(), src_i32.cpu(), b, w, cpu_patch)
    for g_t, w_t in zip(got, want, strict=True):
        assert torch.equal(g_t.cpu(), w_t)  # the stale values past the step's shape untouched too
    if patched:
        assert got[0][0, b - 1].item() == 424242


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_copy_to_host_matches_twin(device: str, dtype: torch.dtype) -> None:
    src = torch.arange(-3, 1500, dtype=dtype, device=device) * 3  # two programs' worth
    dst = _host(torch.zeros(src.shape[0], dtype=torch.int32), device)
    copy_to_host(src, dst)
    if device == "cuda":
        torch.cuda.synchronize()
    want = torch.zeros_like(dst)
    reference.copy_to_host(src.cpu(), want)
    assert torch.equal(dst, want)
    copy_to_host(src[:0], dst[:0])  # nothing to copy: no launch
