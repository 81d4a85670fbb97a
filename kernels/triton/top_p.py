"""Nucleus (top-p) filtering without a sort (twin: `kernels.reference.top_p_mask_`).

A row keeps every token whose logit has less than `top_p` of the row's probability mass
strictly above it (so the most likely token always stays, and tokens of equal logit stay or go
together); the others become -inf, in place. With a sort of the whole vocabulary a 128k-
vocabulary batch of 256 rows sampled in ~4.8 ms a step on an H100 (a decode step's forward is
~8-12 ms there).

Here the logits' order is searched for the threshold instead: a float's bits, sign-folded, are
an integer key in the same order as the float, so the kept set is {key >= k*} for the smallest
key k* whose mass above it is below top_p. Each pass over the row weighs FANOUT candidate keys
at once (the mass above each) and keeps the sixteenth of the interval that holds k*; passes for
the row's maximum and normaliser come first, one writing the -inf last. The interval starts at
the keys of [max - 110, max]: exp of anything further below the maximum is 0 in fp32, so those
tokens carry no mass. Eight passes close any interval of 32-bit keys.

Each pass is a launch over (row, segment) programs, so a few rows still fill the GPU: every
program adds up the segments' partial sums of the pass before (redundantly: a few hundred
floats), takes the same next interval, and weighs its own columns. A row walked by one program
took ~0.4 ms alone on an H100 (the sort's share of a step at one row: ~0.15 ms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit, is_interpreted

_BLOCK = 2048  # columns a program loads at once
_WARPS = 16
_FANOUT = 16  # candidate keys weighed in one pass
_PASSES = 8  # 16^8 = 2^32: any interval of keys closes
_SPAN = 110.0  # logits further than this below the row's maximum weigh 0 (exp underflows)
_PROGRAMS = 264  # aim for this many programs a launch (two an H100 SM), in segments of whole blocks

# Phases of `_top_p_pass_kernel`, one launch each: the maximum, the normaliser, then _PASSES
# weighing passes and the mask.
_MAX, _NORM, _WEIGH, _MASK = 0, 1, 2, 3


@dual_jit()
def _top_p_pass_kernel(
    x_ptr,  # [R, >= V] fp32, masked in place by the last phase
    top_p_ptr,  # [R] fp32
    m_part_ptr,  # [R, S] fp32: each segment's maximum
    z_part_ptr,  # [R, S] fp32: each segment's sum of exp(x - max)
    g_part_ptr,  # [PASSES, R, S, FANOUT] fp32: each weighing pass's sums
    stride_x,
    V,
    seg_len,  # columns a segment (a multiple of BLOCK)
    num_segs,
    k,  # _WEIGH: the pass (0 .. PASSES - 1); _MASK: PASSES
    PHASE: tl.constexpr,
    SEGS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    FANOUT: tl.constexpr,
    SPAN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    top_p = tl.load(top_p_ptr + row)
    if top_p < 1.0:
        base = x_ptr + row * stride_x
        col0 = seg * seg_len
        col1 = tl.minimum(col0 + seg_len, V)
        cols = tl.arange(0, BLOCK)[None, :]
        segs = tl.arange(0, SEGS_PAD)
        seg_ok = segs < num_segs
        part = row * num_segs + seg
        if PHASE == 0:
            m_acc = tl.full([1, BLOCK], float("-inf"), dtype=tl.float32)
            for c in range(col0, col1, BLOCK):
                m_acc = tl.maximum(m_acc, tl.load(base + c + cols, mask=c + cols < col1, other=float("-inf")))
            tl.store(m_part_ptr + part, tl.max(tl.max(m_acc, axis=1), axis=0))
        else:
            m = tl.max(tl.load(m_part_ptr + row * num_segs + segs, mask=seg_ok, other=float("-inf")), axis=0)
            if PHASE == 1:
                z_acc = tl.zeros([1, BLOCK], dtype=tl.float32)
                for c in range(col0, col1, BLOCK):
                    x = tl.load(base + c + cols, mask=c + cols < col1, other=float("-inf"))
                    z_acc += tl.exp(x - m)
                tl.store(z_part_ptr + part, tl.sum(tl.sum(z_acc, axis=1), axis=0))
            else:
                z = tl.sum(tl.load(z_part_ptr + row * num_segs + segs, mask=seg_ok, other=0.0), axis=0)
                target = top_p * z  # mass is compared unnormalised
                # Keys: a float's bits as an int32 in the float's order (negative floats'
                # magnitude bits flipped; -0 taken as +0, its equal). g(key) = mass of the keys
                # above it. Invariant: g(lo) >= target > g(hi): hi = the maximum's key has
                # nothing above it, lo sits below every key that weighs anything.
                lo_bits = (m - SPAN).to(tl.int32, bitcast=True)
                hi_bits = m.to(tl.int32, bitcast=True)
                lo = tl.where(lo_bits >= 0, lo_bits, lo_bits ^ 0x7FFFFFFF).to(tl.int64) - 1
                hi = tl.where(hi_bits >= 0, hi_bits, hi_bits ^ 0x7FFFFFFF).to(tl.int64)
                fan = tl.arange(0, FANOUT)
                # Replay the passes before this one: every program narrows the interval from the
                # segments' sums of each earlier pass, the same way, so nothing but those sums
                # is kept between launches (no program writes what another of its launch reads).
                for p in range(0, k):
                    step = tl.maximum((hi - lo + FANOUT - 1) // FANOUT, 1)
                    cand = tl.minimum(lo + step * (fan.to(tl.int64) + 1), hi)
                    g_rows = g_part_ptr + (p * tl.num_programs(0) + row) * num_segs * FANOUT
                    g_all = tl.load(
                        g_rows + segs[:, None] * FANOUT + fan[None, :], mask=seg_ok[:, None], other=0.0
                    )
                    good = tl.sum(g_all, axis=0) < target  # an up-set: g never grows with the key
                    hi = tl.min(tl.where(good, cand, hi), axis=0)
                    lo = tl.max(tl.where(good, lo, cand), axis=0)
                if PHASE == 2:
                    step = tl.maximum((hi - lo + FANOUT - 1) // FANOUT, 1)
                    cand = tl.minimum(lo + step * (tl.arange(0, FANOUT)[:, None].to(tl.int64) + 1), hi)
                    cand = cand.to(tl.int32)
                    # 2-D throughout ([1, BLOCK] columns against [FANOUT, 1] candidates): built
                    # 1-D and broadcast, each block's keys and weights changed layout through
                    # shared memory.
                    g_lanes = tl.zeros([FANOUT, BLOCK], dtype=tl.float32)
                    for c in range(col0, col1, BLOCK):
                        x = tl.load(base + c + cols, mask=c + cols < col1, other=float("-inf"))
                        bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
                        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
                        g_lanes += tl.where(key > cand, tl.exp(x - m), 0.0)
                    g_out = g_part_ptr + ((k * tl.num_programs(0) + row) * num_segs + seg) * FANOUT
                    tl.store(g_out + fan, tl.sum(g_lanes, axis=1))
                else:
                    for c in range(col0, col1, BLOCK):
                        inside = c + cols < col1
                        x = tl.load(base + c + cols, mask=inside, other=float("-inf"))
                        bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
                        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
                        tl.store(
                            base + c + cols, tl.where(key.to(tl.int64) >= hi, x, float("-inf")), mask=inside
                        )


def top_p_mask_(x: torch.Tensor, top_p: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """Nucleus filtering in place: x [R, >= vocab] fp32 logits (temperature applied), top_p
    [R] fp32 in (0, 1] (1: the row is left alone); columns past `vocab` (default: all) are
    neither read nor written. Returns x."""
    assert x.dim() == 2 and x.dtype == torch.float32 and x.stride(-1) == 1, (x.shape, x.dtype)
    assert top_p.shape == (x.shape[0],) and top_p.dtype == torch.float32, (top_p.shape, top_p.dtype)
    rows = x.shape[0]
    vocab = x.shape[1] if vocab is None else vocab
    if rows == 0 or vocab == 0:
        return x
    block = min(_BLOCK, triton.next_power_of_2(vocab))
    blocks = triton.cdiv(vocab, block)
    # Segments of whole blocks, enough for ~_PROGRAMS programs (one a row past that).
    segs = max(1, min(blocks, _PROGRAMS // rows))
    seg_len = triton.cdiv(blocks, segs) * block
    segs = triton.cdiv(vocab, seg_len)
    m_part = torch.empty((rows, segs), dtype=torch.float32, device=x.device)
    z_part = torch.empty_like(m_part)
    g_part = torch.empty((_PASSES, rows, segs, _FANOUT), dtype=torch.float32, device=x.device)
    warps = 4 if is_interpreted(x.device) else _WARPS
    for phase, k in [(_MAX, 0), (_NORM, 0), *((_WEIGH, p) for p in range(_PASSES)), (_MASK, _PASSES)]:
        _top_p_pass_kernel[(rows, segs)](
            x,
            top_p,
            m_part,
            z_part,
            g_part,
            x.stride(0),
            vocab,
            seg_len,
            segs,
            k,
            PHASE=phase,
            SEGS_PAD=max(2, triton.next_power_of_2(segs)),
            BLOCK=block,
            FANOUT=_FANOUT,
            SPAN=_SPAN,
            num_warps=warps,
        )
    return x
