"""The scales of an fp8 KV cache: one per layer for K and one for V, measured once at start.

What others do: vLLM's `kv_cache_dtype="fp8"` uses 1.0 for every scale unless the checkpoint
carries calibrated ones (llm-compressor: per tensor, or per head on its FlashAttention
backend), or, with `calculate_kv_scales`, takes amax / 200 (K) and amax / 100 (V) of the
first batch it serves. FlashInfer takes one scalar per tensor and folds it into its two
GEMMs' scales, as our paged attention does.

What llmesh does, and why:

* **Measured at start, not on the first request.** A block's bytes mean nothing without its
  scales, so the scales are part of the cache layout that the fingerprint names (every block
  key, the KV store's namespace). They must be fixed before the worker registers and names its
  first block, and equal on every worker of the same model so that those share blocks. So the
  executor runs one prefill of a fixed calibration prompt (seeded pseudo-random token ids, as
  vLLM's random-token calibration) into a small scratch cache in the model's dtype, before
  the real cache is allocated, and reads K's and V's amax per layer off it.
* **Powers of two, with headroom.** scale = 2**ceil(log2(amax * 4 / 448)): the calibration's
  largest value lands between 448/8 and 448/4, so text unlike the calibration prompt has 4x to
  8x of room before saturating. e4m3 is a floating format: its relative precision is the same
  (3 mantissa bits) across its normal range of 2**15, so the scale only places that range and
  the headroom costs nothing but the smallest values (1/3,500 of amax and below go
  subnormal). A power of two also makes the scaling exact, and absorbs last-bit differences in
  amax between devices or tensor-parallel sizes, so that equal models get equal fingerprints.
* **Per layer, not per head.** With the range that wide, a head whose values are 10x smaller
  than its layer's largest loses nothing; per-head scales pay off for int8 (uniform steps),
  not e4m3. Per tensor keeps each kernel's scale a scalar folded into the softmax scale (K) and
  the output (V). With tensor parallelism each rank measures its heads and the ranks take the
  largest exponent, so the scales are those a single rank would measure.
"""

from __future__ import annotations

import math

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.reference import FP8_MAX
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_cache
from worker_svc.parallel import TensorParallel

CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0
HEADROOM = 4.0  # the calibration's amax maps to at most 448 / HEADROOM
_MIN_EXPONENT = -40  # an all-zero tensor (a dead layer) still gets a finite scale


def scale_exponent(amax: float) -> int:
    """The power of two e for which amax * HEADROOM / 2**e fits in e4m3's 448, the smallest one."""
    if not amax > 0.0 or not math.isfinite(amax):
        return _MIN_EXPONENT if not amax > 0.0 else 0
    return max(math.ceil(math.log2(amax * HEADROOM / FP8_MAX)), _MIN_EXPONENT)


def scales_vector(k_exp: int, v_exp: int, device: torch.device | str) -> torch.Tensor:
    """The kernels' fp32 [4] (k_scale, v_scale, 1 / k_scale, 1 / v_scale) of two exponents."""
    return torch.tensor(
        [2.0**k_exp, 2.0**v_exp, 2.0**-k_exp, 2.0**-v_exp], dtype=torch.float32, device=device
    )


def calibration_prompt(vocab_size: int, max_len: int) -> torch.Tensor:
    """The fixed calibration token ids: seeded, the same on every worker."""
    n = min(CALIBRATION_TOKENS, max_len)
    g = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (n,), generator=g)


@torch.inference_mode()
def measure_kv_exponents(
    model: torch.nn.Module,
    spec: KVCacheSpec,
    vocab_size: int,
    max_len: int,
    device: torch.device,
    tp: TensorParallel,
) -> list[tuple[int, int]]:
    """(K exponent, V exponent) per layer from one prefill of the calibration prompt.

    `spec`: this rank's cache in the model's dtype (the scratch cache's layout). Every
    tensor-parallel rank calls this at the same point (the forward and the maximum are
    collectives).
    """
    ids = calibration_prompt(vocab_size, max_len)
    n, bs = ids.numel(), spec.block_size
    num_blocks = -(-n // bs)
    caches = allocate_kv_cache(spec, num_blocks, device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
        max_query_len=n,
        max_seq_len=n,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
    )
    model(ids.to(device), torch.arange(n, device=device), caches, meta)
    # [layers, 2] amax of K and of V (one host copy, once, at start).
    amax = torch.stack([c.float().abs().amax(dim=(1, 2, 3, 4)) for c in caches]).cpu().tolist()
    exps = [(scale_exponent(k), scale_exponent(v)) for k, v in amax]
    if tp.size > 1:  # the largest over the ranks' heads: -min(-e)
        exps = [(-tp.min_int(-k, device), -tp.min_int(-v, device)) for k, v in exps]
    return exps


def attach_kv_scales(model: torch.nn.Module, exps: list[tuple[int, int]], device: torch.device) -> None:
    """Give each attention layer its scales vector (`Attention.kv_scale`), which it passes to
    the backend: CUDA graphs captured later read them from these tensors."""
    layers = [m for m in model.modules() if hasattr(m, "kv_scale")]
    assert len(layers) == len(exps), (len(layers), len(exps))
    for layer, (k, v) in zip(layers, exps, strict=True):
        layer.kv_scale = scales_vector(k, v, device)


def describe(exps: list[tuple[int, int]]) -> str:
    """The exponents as a short string for the cache layout's fingerprint: "k,v;k,v;..."."""
    return ";".join(f"{k},{v}" for k, v in exps)
