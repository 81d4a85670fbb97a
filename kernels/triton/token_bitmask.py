"""Structured outputs' token mask applied to the logits in one pass (twin:
`kernels.reference.apply_token_bitmask_`).

The grammar engine fills a packed bitmask on the host (int32 words, bit t % 32 of word t // 32
set = token t allowed); it reaches the device as ~16 KB per row for a 128k vocabulary. The torch
twin expands it to one int32 per token and runs four elementwise kernels over [rows, vocab];
here each program reads its tokens' words (32 tokens share one, from cache) and writes -inf
only where a token is refused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit

BLOCK = 1024  # tokens per program


@dual_jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    mask_ptr,
    stride_logits,
    stride_mask,
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab
    words = tl.load(mask_ptr + row * stride_mask + (tokens >> 5), mask=inside, other=-1)
    refused = ((words >> (tokens & 31)) & 1) == 0
    neg = tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + tokens, neg, mask=inside & refused)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits [rows, >= vocab] of refused tokens -> -inf, in place; `bitmask` int32
    [rows, width] on the same device. Tokens past 32 * width are left alone (as the twin)."""
    rows = logits.shape[0]
    assert bitmask.shape[0] == rows and bitmask.dtype == torch.int32, (bitmask.shape, bitmask.dtype)
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    if rows == 0 or vocab == 0:
        return logits
    grid = (rows, triton.cdiv(vocab, BLOCK))
    _apply_token_bitmask_kernel[grid](
        logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, BLOCK=BLOCK
    )
    return logits
