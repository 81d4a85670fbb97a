"""Nucleus (top-p) filtering without a sort (twin: `kernels.reference.top_p_mask_`).

A row keeps every token whose logit has less than `top_p` of the row's probability mass
strictly above it (so the most likely token always stays, and tokens of equal logit stay or go
together); the others become -inf, in place. With a sort of the whole vocabulary, as the
sampler does for small batches, a 128k-vocabulary batch of 256 rows sampled in ~4.8 ms a step
on an H100 (a decode step's forward is ~8-12 ms there); this search takes ~1.1 ms of it. A row
is one program, ~0.4 ms alone, so small batches keep the sort (`Sampler._searches_nucleus`).

Here one program a row searches the logits' order for the threshold instead: a float's bits,
sign-folded, are an integer key in the same order as the float, so the kept set is {key >= k*}
for the smallest key k* whose mass above it is below top_p. Each pass over the row weighs
FANOUT candidate keys at once (the mass above each), and keeps the sixteenth of the interval
that holds k*; a pass to find the row's maximum and normaliser comes first, a pass writing the
-inf last. The interval starts at the keys of [max - 110, max]: exp of anything further below
the maximum is 0 in fp32, so those tokens carry no mass. About 7-8 passes over the row in all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit

# Columns a pass loads at once, and the program's warps: on an H100 at 128k columns, 16 warps
# of 2,048 took a row 0.41 ms alone (8 of 1,024: 0.58; 32 of 4,096 spilled: 0.79) and 256
# rows 1.11 ms (1.08).
_BLOCK = 2048
_WARPS = 16
_FANOUT = 16  # candidate keys weighed in one pass over the row
_PASSES = 8  # 16^8 = 2^32: any interval of keys closes
_SPAN = 110.0  # logits further than this below the row's maximum weigh 0 (exp underflows)


@dual_jit()
def _top_p_mask_kernel(
    x_ptr,  # [R, >= V] fp32, masked in place
    top_p_ptr,  # [R] fp32
    stride_x,
    V,
    BLOCK: tl.constexpr,
    FANOUT: tl.constexpr,
    PASSES: tl.constexpr,
    SPAN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    top_p = tl.load(top_p_ptr + row)
    if top_p < 1.0:
        base = x_ptr + row * stride_x
        offs = tl.arange(0, BLOCK)
        m_acc = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        for c in range(0, V, BLOCK):
            x = tl.load(base + c + offs, mask=c + offs < V, other=float("-inf"))
            m_acc = tl.maximum(m_acc, x)
        m = tl.max(m_acc, axis=0)
        z_acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(0, V, BLOCK):
            x = tl.load(base + c + offs, mask=c + offs < V, other=float("-inf"))
            z_acc += tl.exp(x - m)
        target = top_p * tl.sum(z_acc, axis=0)  # mass is compared unnormalised

        # Keys: a float's bits as an int32 in the float's order (negative floats' magnitude
        # bits flipped; -0 taken as +0, its equal). g(k) = mass of the keys above k. Invariant:
        # g(lo) >= target > g(hi): hi = the maximum's key has nothing above it, lo sits below
        # every key that weighs anything.
        lo_bits = (m - SPAN).to(tl.int32, bitcast=True)
        hi_bits = m.to(tl.int32, bitcast=True)
        lo = tl.where(lo_bits >= 0, lo_bits, lo_bits ^ 0x7FFFFFFF).to(tl.int64) - 1
        hi = tl.where(hi_bits >= 0, hi_bits, hi_bits ^ 0x7FFFFFFF).to(tl.int64)
        # A fixed number of passes (PASSES of FANOUT: 16^8 covers every 32-bit span), not a
        # `while`: Triton pipelines the loads of a loop nested in a counted loop, and unpipelined
        # each block's load waited its full latency (~0.7 ms a 128k row on an H100). A pass
        # after the interval closed changes nothing.
        for _ in range(PASSES):
            # FANOUT increasing candidates splitting (lo, hi]; the last is hi. Each keeps its
            # own per-lane sums, reduced once the pass is over.
            step = tl.maximum((hi - lo + FANOUT - 1) // FANOUT, 1)
            # 2-D throughout ([1, BLOCK] columns against [FANOUT, 1] candidates): built 1-D and
            # broadcast, each block's keys and weights changed layout through shared memory.
            g_lanes = tl.zeros([FANOUT, BLOCK], dtype=tl.float32)
            fan = tl.arange(0, FANOUT)[:, None]
            cand = tl.minimum(lo + step * (fan.to(tl.int64) + 1), hi).to(tl.int32)
            cols = tl.arange(0, BLOCK)[None, :]
            for c in range(0, V, BLOCK):
                x = tl.load(base + c + cols, mask=c + cols < V, other=float("-inf"))
                bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
                key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
                w = tl.exp(x - m)
                g_lanes += tl.where(key > cand, w, 0.0)
            g = tl.sum(g_lanes, axis=1)[:, None]
            good = g < target  # an up-set of the candidates: g never grows with the key
            hi = tl.min(tl.min(tl.where(good, cand.to(tl.int64), hi), axis=1), axis=0)
            lo = tl.max(tl.max(tl.where(good, lo, cand.to(tl.int64)), axis=1), axis=0)
        for c in range(0, V, BLOCK):
            inside = c + offs < V
            x = tl.load(base + c + offs, mask=inside, other=float("-inf"))
            bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
            key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            tl.store(base + c + offs, tl.where(key.to(tl.int64) >= hi, x, float("-inf")), mask=inside)


def top_p_mask_(x: torch.Tensor, top_p: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """Nucleus filtering in place: x [R, >= vocab] fp32 logits (temperature applied), top_p
    [R] fp32 in (0, 1] (1: the row is left alone); columns past `vocab` (default: all) are
    neither read nor written. Returns x."""
    assert x.dim() == 2 and x.dtype == torch.float32 and x.stride(-1) == 1, (x.shape, x.dtype)
    assert top_p.shape == (x.shape[0],) and top_p.dtype == torch.float32, (top_p.shape, top_p.dtype)
    vocab = x.shape[1] if vocab is None else vocab
    if x.shape[0] == 0 or vocab == 0:
        return x
    _top_p_mask_kernel[(x.shape[0],)](
        x,
        top_p,
        x.stride(0),
        vocab,
        BLOCK=min(_BLOCK, triton.next_power_of_2(vocab)),
        FANOUT=_FANOUT,
        PASSES=_PASSES,
        SPAN=_SPAN,
        num_warps=_WARPS,
    )
    return x
