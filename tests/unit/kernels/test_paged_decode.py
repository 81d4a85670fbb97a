"""The decode kernel (`kernels.triton.paged_decode`) against the PyTorch twin, interpreted on the CPU.

Pure-decode batches (one query per sequence) of uneven lengths, so that split segments past a
short sequence's end see no key; the fp8 cache with non-unit scales and fp16 dots; the fused
merge (the last segment merges, its counters left zeroed for the next launch); the split
heuristic; and the switch back to the unified kernel.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

import kernels.triton as kt
from kernels import reference
from kernels.triton import paged_decode as pd
from tests.unit.kernels import make_paged_batch, rope_cache

pa_mod = importlib.import_module("kernels.triton.paged_attention")

# (new tokens, context length): pure decode, lengths around the tile and block sizes.
DECODES = [(1, 1), (1, 37), (1, 130), (1, 64)]
SCALES = torch.tensor([0.5, 2.0, 2.0, 0.5])


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert torch.isfinite(out).all()
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert err < tol, err


def _batch(dtype: torch.dtype, group: int, head_dim: int = 32, block_size: int = 16):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return make_paged_batch(
        DECODES, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype
    )


@pytest.mark.parametrize(("group", "num_splits"), [(1, 1), (4, 4), (6, 4)])
def test_decode_matches_twin(group: int, num_splits: int) -> None:
    b = _batch(torch.float32, group)
    cfg = pd.DecodeConfig(tile=32, num_warps=4, num_stages=2, dot_f16=False)
    out = pd.paged_decode(
        b.q, b.kv_cache, b.meta, 0.3, torch.full_like(b.q, float("nan")), num_splits=num_splits, config=cfg
    )
    _close(out, reference.paged_attention(b.q, b.kv_cache, b.meta, 0.3), 1e-5)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_decode_fp8_cache_matches_twin(fused: bool, q_dtype: torch.dtype) -> None:
    b = _batch(q_dtype, 4)
    cache = (b.kv_cache.float() * 4).to(torch.float8_e4m3fn)
    cfg = pd.DecodeConfig(tile=32, num_warps=4, num_stages=2, dot_f16=True, fused_merge=fused)
    out = torch.full_like(b.q, float("nan"))
    pd.paged_decode(b.q, cache, b.meta, 0.2, out, num_splits=8, kv_scale=SCALES, config=cfg)
    expected = reference.paged_attention(b.q.float(), cache, b.meta, 0.2, SCALES)
    _close(out, expected, 2e-2 if q_dtype == torch.bfloat16 else 1e-5)
    if fused:  # every counter back to zero for the next launch
        assert int(pd._counters(b.q.device, 1).abs().sum()) == 0


def test_decode_odd_head_dim_and_block_size() -> None:
    torch.manual_seed(1)
    b = make_paged_batch(
        DECODES, num_heads=6, num_kv_heads=2, head_dim=24, block_size=32, dtype=torch.float32
    )
    out = pd.paged_decode(b.q, b.kv_cache, b.meta, 0.3, torch.empty_like(b.q), num_splits=2)
    _close(out, reference.paged_attention(b.q, b.kv_cache, b.meta, 0.3), 1e-5)


def _decodes(num_seqs: int, ctx: int):  # type: ignore[no-untyped-def]
    """Metadata of `num_seqs` decodes at context `ctx` (the split and routing rules read only it)."""
    return make_paged_batch(
        [(1, ctx)] * num_seqs,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        block_size=16,
        dtype=torch.float32,
    ).meta


def test_split_heuristic_fills_the_sms_once() -> None:
    cpu = torch.device("cpu")  # 16 "SMs" (pd._num_sms): 2 programs each = 32 programs
    assert pd.choose_decode_splits(_decodes(1, 4096), 8, cpu) == 4  # 8 KV heads x 4 segments
    assert pd.choose_decode_splits(_decodes(1, 4096), 1, cpu) == 16  # capped by 4096 / 256 tokens
    assert pd.choose_decode_splits(_decodes(1, 300), 1, cpu) == 1  # too short to split
    assert pd.choose_decode_splits(_decodes(8, 4096), 4, cpu) == 1  # the batch fills the SMs
    assert pd.choose_decode_splits(_decodes(6, 4096), 4, cpu) == 1  # 24 programs: 2 would be 2 waves


def test_batch_programs_follow_the_grid() -> None:
    """`plan_decode` on 16 "SMs", by (sequence, KV head) programs an SM: batch 1 the batch-1
    config and its splits (split over an fp8 cache: warp-split programs); a batch longest context
    first, with the batch-1 config and its splits up to 12, 64-token tiles two deep unsplit
    beyond, and past 40 (fp8) one-warp 32-token ones."""
    cpu = torch.device("cpu")
    base = pd.pick_decode_config(128, True)
    one, n = pd.plan_decode(_decodes(1, 4096), 8, 128, True, cpu)
    assert one == pd.with_warp_split(base, n, 4096) and one.warp_split and n == 4
    assert (one.tile, one.num_warps, one.num_stages) == (64, 4, 5)
    assert pd.plan_decode(_decodes(1, 300), 8, 128, True, cpu) == (base, 1)  # unsplit: plain programs
    assert pd.plan_decode(_decodes(1, 2048), 8, 128, True, cpu) == (base, 4)  # 512-token segments: plain
    # A forced split gets that split's programs: none, or more partials than the merge holds: plain.
    assert pd.plan_decode(_decodes(1, 4096), 8, 128, True, cpu, num_splits=1) == (base, 1)
    assert pd.plan_decode(_decodes(1, 1 << 17), 8, 128, True, cpu, num_splits=64) == (base, 64)
    assert pd.plan_decode(_decodes(1, 1 << 17), 8, 128, True, cpu, num_splits=32)[0].warp_split
    few, n = pd.plan_decode(_decodes(8, 4096), 1, 128, True, cpu)
    assert few == replace(one, longest_first=True) and n == 4
    unsplit = replace(base, longest_first=True)
    assert pd.plan_decode(_decodes(64, 4096), 1, 128, True, cpu) == (unsplit, 1)  # ~3 an SM on: unsplit
    assert pd.plan_decode(_decodes(192, 300), 1, 128, True, cpu) == (unsplit, 1)  # 12 an SM
    mid, n = pd.plan_decode(_decodes(193, 300), 1, 128, True, cpu)
    assert (mid.tile, mid.num_warps, mid.num_stages, mid.kv_words, mid.longest_first, n) == (
        64,
        4,
        2,
        True,
        True,
        1,
    )
    assert pd.plan_decode(_decodes(640, 300), 1, 128, True, cpu)[0] == mid
    many, n = pd.plan_decode(_decodes(641, 300), 1, 128, True, cpu)
    assert (many.tile, many.num_warps, many.kv_words, many.longest_first, n) == (32, 1, True, True, 1)
    bf16, n = pd.plan_decode(_decodes(641, 300), 1, 128, False, cpu)
    assert (bf16.tile, bf16.num_warps, bf16.dot_f16, bf16.kv_words, bf16.longest_first, n) == (
        64,
        2,
        False,
        False,
        True,
        1,
    )
    assert pd.plan_decode(_decodes(65, 300), 1, 128, False, cpu) == (
        replace(pd.pick_decode_config(128, False), longest_first=True),
        1,
    )


def test_which_decodes_take_the_decode_kernel() -> None:
    """An fp8 cache always; otherwise batches of more than 4 programs an SM and long contexts
    on grids that leave the SMs idle."""
    cpu = torch.device("cpu")  # 16 "SMs": 32 programs
    assert pd.takes_decode_kernel(_decodes(1, 300), 8, True, cpu, None)  # fp8: always
    assert not pd.takes_decode_kernel(_decodes(1, 300), 1, False, cpu, None)  # short
    assert pd.takes_decode_kernel(_decodes(1, 16384), 1, False, cpu, None)  # 32 splits, 32 programs
    assert not pd.takes_decode_kernel(_decodes(2, 16384), 1, False, cpu, None)  # 16 splits a sequence
    assert not pd.takes_decode_kernel(_decodes(1, 16384), 2, False, cpu, 32)  # forced: 64 programs
    assert not pd.takes_decode_kernel(_decodes(64, 300), 1, False, cpu, None)  # 4 an SM
    assert pd.takes_decode_kernel(_decodes(65, 300), 1, False, cpu, None)  # a batch past 4 an SM
    assert not pd.takes_decode_kernel(_decodes(65, 300), 1, False, cpu, 1)  # splits forced: unified


def test_unified_switch_keeps_the_old_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    b = _batch(torch.float32, 2)
    cache = b.kv_cache.to(torch.float8_e4m3fn)  # an fp8 cache would take the decode kernel
    expected = reference.paged_attention(b.q, cache, b.meta, 0.25, SCALES)
    monkeypatch.setattr(pa_mod, "_UNIFIED_DECODE", True)
    monkeypatch.setattr(pa_mod, "paged_decode", None)  # would raise if called
    out = kt.paged_attention(b.q, cache, b.meta, 0.25, num_splits=4, kv_scale=SCALES)
    _close(out, expected, 1e-5)


WORDS = pd.DecodeConfig(tile=32, num_warps=4, num_stages=2, dot_f16=True, kv_words=True)
# Each warp its own slice of a tile: 16-token slices (tl.dot's smallest N), 4 or 2 warps.
WARP_SPLIT = [
    replace(WORDS, tile=64, warp_split=True),
    replace(WORDS, tile=32, num_warps=2, warp_split=True),
]


@pytest.mark.parametrize("cfg", [WORDS, *WARP_SPLIT], ids=["words", "warp-split-4", "warp-split-2"])
@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_fp8_cache_as_words_matches_twin(num_splits: int, cfg: pd.DecodeConfig) -> None:
    """Lengths 1, 37, 130, 64: with warps splitting a tile, warps past a short context see no
    key (their partial's lse -inf), and a split's segment may hold no tile at all."""
    b = _batch(torch.bfloat16, 4)
    cache = (b.kv_cache.float() * 4).to(torch.float8_e4m3fn)
    out = torch.full_like(b.q, float("nan"))
    pd.paged_decode(b.q, cache, b.meta, 0.2, out, num_splits=num_splits, kv_scale=SCALES, config=cfg)
    expected = reference.paged_attention(b.q.float(), cache, b.meta, 0.2, SCALES)
    _close(out, expected, 2e-2)


def test_decode_fp8_words_read_every_code() -> None:
    """A cache of random codes (every one but NaN; subnormals, both signs) through the word path."""
    b = _batch(torch.bfloat16, 4)
    codes = torch.randint(0, 256, b.kv_cache.shape, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0
    cache = codes.view(torch.float8_e4m3fn)
    cfg = pd.DecodeConfig(tile=32, num_warps=4, num_stages=2, dot_f16=True, kv_words=True)
    q = (b.q.float() * 0.01).to(torch.bfloat16)
    out = pd.paged_decode(q, cache, b.meta, 0.2, torch.full_like(q, float("nan")), num_splits=2, config=cfg)
    _close(out, reference.paged_attention(q.float(), cache, b.meta, 0.2), 2e-2)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_longest_first_matches_twin_and_shares_its_order(num_splits: int) -> None:
    """Grid rows in order of context length (DECODES' lengths 1, 37, 130, 64): the same output;
    the order is built once on the metadata and reused by the next layer's launch."""
    b = _batch(torch.float32, 4)
    cfg = pd.DecodeConfig(tile=32, num_warps=4, num_stages=2, dot_f16=False, longest_first=True)
    out = pd.paged_decode(
        b.q, b.kv_cache, b.meta, 0.3, torch.full_like(b.q, float("nan")), num_splits=num_splits, config=cfg
    )
    _close(out, reference.paged_attention(b.q, b.kv_cache, b.meta, 0.3), 1e-5)
    order = b.meta.decode_order
    assert order is not None and order.tolist() == [2, 3, 1, 0]
    pd.paged_decode(b.q, b.kv_cache, b.meta, 0.3, out, num_splits=num_splits, config=cfg)
    assert b.meta.decode_order is order


def _q_rotary(b, max_pos: int = 256):  # type: ignore[no-untyped-def]
    """Each decode token's position (its context length - 1) and a rope table for the batch."""
    positions = (b.meta.seq_lens.to(torch.int64) - 1).clamp_min(0)
    return positions, rope_cache(max_pos, b.q.shape[-1])


@pytest.mark.parametrize(
    ("cache_dtype", "q_dtype", "cfg"),
    [
        (torch.bfloat16, torch.bfloat16, pd.DecodeConfig(tile=32, num_warps=4, num_stages=2, dot_f16=False)),
        (torch.float32, torch.float32, pd.DecodeConfig(tile=16, num_warps=4, num_stages=2, dot_f16=False)),
        (torch.float8_e4m3fn, torch.bfloat16, WORDS),
        (torch.float8_e4m3fn, torch.bfloat16, WARP_SPLIT[0]),
    ],
)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_rotating_q_is_rotate_then_attend_bit_for_bit(
    cache_dtype: torch.dtype, q_dtype: torch.dtype, cfg: pd.DecodeConfig, num_splits: int
) -> None:
    """`q_rotary`: the kernel rotates the raw q as the cache write would have, then attends: the
    same bits as the cache-write kernel rotating q and the kernel attending to the rotated q.
    Lengths 1, 37, 130, 64 at 16- or 32-token tiles: a newest tile that is full (64), ragged, and
    alone (1), and segments with no newest tile."""
    b = _batch(q_dtype, 4, head_dim=32)
    cache = b.kv_cache if cache_dtype != torch.float8_e4m3fn else (b.kv_cache.float() * 4).to(cache_dtype)
    scales = SCALES if cache_dtype == torch.float8_e4m3fn else None
    positions, cos_sin = _q_rotary(b)
    assert pd.rotates_q(b.q, cos_sin)
    rotated = b.q.clone()
    kt.rotary_and_write_kv(
        positions, rotated, b.k.clone(), b.v, cos_sin, cache.clone(), torch.full_like(positions, -1)
    )
    expected = pd.paged_decode(
        rotated, cache, b.meta, 0.3, torch.empty_like(b.q), num_splits=num_splits, kv_scale=scales, config=cfg
    )
    raw = b.q.clone()
    out = pd.paged_decode(
        raw, cache, b.meta, 0.3, torch.full_like(b.q, float("nan")),
        num_splits=num_splits, kv_scale=scales, config=cfg, q_rotary=(positions, cos_sin),
    )  # fmt: skip
    assert torch.equal(out, expected)
    assert torch.equal(raw, b.q)  # q itself is left as it was


def test_cache_write_leaves_q_to_the_decode_kernel() -> None:
    """`rotate_q=False`: k rotated and both written as before, q untouched (the twin alike)."""
    b = _batch(torch.bfloat16, 4)
    positions, cos_sin = _q_rotary(b)
    slots = torch.arange(b.q.shape[0], dtype=torch.int64)
    for fn in (kt.rotary_and_write_kv, reference.rotary_and_write_kv):
        q, k, cache = b.q.clone(), b.k.clone(), b.kv_cache.clone()
        fn(positions, q, k, b.v, cos_sin, cache, slots, rotate_q=False)
        q_all, k_all, cache_all = b.q.clone(), b.k.clone(), b.kv_cache.clone()
        fn(positions, q_all, k_all, b.v, cos_sin, cache_all, slots)
        assert torch.equal(q, b.q) and not torch.equal(q_all, b.q)
        assert torch.equal(k, k_all) and torch.equal(cache, cache_all)


def test_backend_leaves_q_to_the_decode_kernel_where_it_rotates_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton backend's pure decodes on the decode kernel (an fp8 cache) leave q to it and
    match the torch backend; LLMESH_DECODE_ROTATES_Q=0's switch and a mixed batch rotate q in
    the cache write, as before."""
    from worker_svc.attention.torch_paged import TorchPagedBackend
    from worker_svc.attention.triton_paged import TritonPagedBackend

    b = _batch(torch.bfloat16, 4)
    positions, cos_sin = _q_rotary(b)
    cache = torch.zeros_like(b.kv_cache, dtype=torch.float8_e4m3fn)
    assert pa_mod.decode_rotates_q(b.q, cache, b.meta, cos_sin)
    assert not pa_mod.decode_rotates_q(b.q, b.kv_cache, b.meta, cos_sin)  # short bf16: the unified kernel
    assert not pa_mod.decode_rotates_q(b.q, cache, b.meta, cos_sin[:, :16])  # a partial rotary
    monkeypatch.setattr(pd, "_DECODE_ROTATES_Q", False)
    assert not pa_mod.decode_rotates_q(b.q, cache, b.meta, cos_sin)
    monkeypatch.undo()
    outs = []
    for backend in (TritonPagedBackend(), TorchPagedBackend()):
        q, k, c = b.q.clone(), b.k.clone(), cache.clone()
        o = backend.forward(q, k, b.v, c, b.meta, 0.3, rotary=(positions, cos_sin), kv_scale=SCALES)
        outs.append(o.float())
    _close(outs[0], outs[1], 2e-2)
