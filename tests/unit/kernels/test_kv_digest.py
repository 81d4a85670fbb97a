"""The KV payload digest (kernels/kv_digest.py) against its float64 twin, and its key."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_digest import (
    LANES,
    ROW_BYTES,
    digest_key,
    digest_rows,
    kv_digest,
    kv_digest_batch,
    kv_digest_reference,
)

KEY = digest_key(b"secret of the test")


def test_the_key_is_deterministic_nonzero_and_spread() -> None:
    assert KEY.shape == (ROW_BYTES, LANES) and KEY.dtype == torch.int8
    assert torch.equal(KEY, digest_key(b"secret of the test"))
    assert not torch.equal(KEY, digest_key(b"another secret"))
    assert int((KEY == 0).sum()) == 0
    assert int(KEY.min()) == -127 and int(KEY.max()) == 127
    assert len(torch.unique(KEY)) == 254


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((2, 4, ROW_BYTES // 8), torch.float32),
        ((3, 5, 7), torch.bfloat16),
        ((1,), torch.uint8),
        ((40, ROW_BYTES // 2), torch.float16),
    ],
)
def test_the_digest_is_its_twin_exactly(shape, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    data = (
        torch.randint(
            0,
            256,
            (torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size(),),
            generator=g,
            dtype=torch.uint8,
        )
        .view(dtype)
        .view(shape)
    )
    d = kv_digest(data, KEY)
    assert d.dtype == torch.int32 and d.shape == (digest_rows(data.numel() * data.element_size()), LANES)
    assert torch.equal(d, kv_digest_reference(data, KEY))


def test_extreme_bytes_stay_exact() -> None:
    """All -128 against the key's extremes: the largest sums an int32 GEMM must hold."""
    worst = torch.full((ROW_BYTES * 2,), -128, dtype=torch.int8)
    assert torch.equal(kv_digest(worst, KEY), kv_digest_reference(worst, KEY))


def test_one_flipped_byte_anywhere_changes_the_digest() -> None:
    data = torch.zeros(3 * ROW_BYTES + 100, dtype=torch.uint8)
    base = kv_digest(data, KEY)
    for pos in (0, ROW_BYTES - 1, 2 * ROW_BYTES + 5, data.numel() - 1):
        changed = data.clone()
        changed[pos] ^= 1
        assert not torch.equal(kv_digest(changed, KEY), base)


def test_a_batch_is_the_digest_of_each_chunk() -> None:
    for chunk_bytes in (ROW_BYTES * 2, 1000):  # whole rows (one GEMM), and padded chunks
        chunks = torch.randint(0, 256, (20, chunk_bytes), dtype=torch.uint8)
        batch = kv_digest_batch(chunks, KEY)
        assert torch.equal(batch, torch.stack([kv_digest(c, KEY) for c in chunks]))

