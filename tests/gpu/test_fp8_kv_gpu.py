"""The fp8 KV cache on the GPU: its kernels against their twins at serving sizes (Llama-3.1-8B
heads: 32 query / 8 KV, D=128, block 16), and an engine whose cache is fp8.

The writes' cast rounds to nearest even as torch's CUDA cast does (a rare code one step away
is allowed, as for the FP8 activations). Paged
attention reads the same fp8 cache as the twin (run in fp32 on it): within a bf16 rounding.
"""

from __future__ import annotations

import random

import pytest
import torch

import kernels.triton as kt
from kernels import reference
from tests.unit.kernels import make_paged_batch, rope_cache

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
BF16_TOL = 2e-2


def _scales() -> torch.Tensor:
    return torch.tensor([0.25, 0.0625, 4.0, 16.0], device="cuda")


def _as_fp8(cache: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.stack([reference.quantize_kv(cache[0], s[2]), reference.quantize_kv(cache[1], s[3])])


def test_fp8_kv_write_matches_twin() -> None:
    t, hkv, d, num_blocks = 300, 8, 128, 64
    qkv = torch.randn(t, (32 + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16) * 8
    k = qkv[:, 32 * d : (32 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (32 + hkv) * d :].view(t, hkv, d)
    slots = torch.randperm(num_blocks * 16, device="cuda")[:t]
    cache = torch.zeros(2, num_blocks, 16, hkv, d, dtype=FP8, device="cuda")
    expected = cache.clone()
    kt.write_kv_cache(k, v, cache, slots, _scales())
    reference.write_kv_cache(k, v, expected, slots, _scales())
    # As tests/gpu/test_fp8_gpu.py allows the activation quantization: the compiled kernel may
    # land a value on a rounding point one code away from torch's cast, rarely.
    a, b = cache.float(), expected.float()
    diff = (a - b).abs()
    assert (diff <= torch.maximum(b.abs() / 8, torch.full_like(b, 2**-9)) * 1.01).all()
    print(f"fp8 KV write: {(diff > 0).sum().item()} of {diff.numel()} codes differ from the twin's")
    assert (diff > 0).float().mean() <= 1e-3


def test_fp8_rotary_kv_write_matches_twin() -> None:
    t, h, hkv, d, num_blocks = 257, 32, 8, 128, 32
    cos_sin = rope_cache(4096, d).cuda()
    positions = torch.randint(0, 4096, (t,), device="cuda")
    slots = torch.randperm(num_blocks * 16, device="cuda")[:t]
    qkv = torch.randn(t, (h + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16) * 4

    def run(fn) -> torch.Tensor:
        x = qkv.clone()
        q, k, v = x.split([h * d, hkv * d, hkv * d], dim=-1)
        cache = torch.zeros(2, num_blocks, 16, hkv, d, dtype=FP8, device="cuda")
        fn(positions, q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d), cos_sin, cache, slots, _scales())
        return cache

    a, b = run(kt.rotary_and_write_kv).float(), run(reference.rotary_and_write_kv).float()
    # A rotated key one bf16 step apart (fused vs unfused rounding) may land one e4m3 step apart.
    assert ((a - b).abs() <= b.abs() / 8 + 1e-3).all()
    assert (a != b).float().mean() < 0.02


@pytest.mark.parametrize(
    "seqs",
    [
        [(1, 4096)] * 4 + [(1, 100)] * 28,  # pure decode, batch 32
        [(1, 32768)],  # batch 1 at 32k: split-K
        [(512, 2048), (1, 300), (77, 77), (1, 5000)],  # mixed: chunked prefill, a prompt, decodes
    ],
    ids=["decode32", "decode1x32k", "mixed"],
)
def test_fp8_paged_attention_matches_twin(seqs: list[tuple[int, int]]) -> None:
    b = make_paged_batch(
        seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda"
    )
    s = _scales()
    cache = _as_fp8(b.kv_cache * 2, s)
    out = kt.paged_attention(b.q, cache, b.meta, 128**-0.5, kv_scale=s)
    expected = reference.paged_attention(b.q.float(), cache, b.meta, 128**-0.5, s)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, atol=BF16_TOL, rtol=BF16_TOL)


def test_engine_with_an_fp8_cache_on_the_gpu(tmp_path) -> None:
    """A small random-weight engine: the Triton backend with CUDA graphs against the torch
    backend, both over an fp8 cache with the same (calibrated) scales; twice the blocks of bf16."""
    from benchmarks.gpu import SMOKE_SHAPES, write_config
    from llmesh import LLM, SamplingParams

    path = write_config(str(tmp_path), "llama-tiny", SMOKE_SHAPES["llama-tiny"])
    common = dict(load_format="dummy", dtype="bfloat16", max_model_len=1024, max_num_seqs=8, seed=0)
    plain = LLM(path, **common, gpu_memory_utilization=0.3)
    blocks_bf16 = plain.engine.runner.num_kv_blocks
    plain.close()
    fp8 = LLM(path, **common, gpu_memory_utilization=0.3, kv_cache_dtype="fp8")
    assert fp8.engine.runner.kv_caches[0].dtype == FP8
    assert fp8.engine.runner.num_kv_blocks >= 1.9 * blocks_bf16
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (17, 130, 431)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in fp8.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    fp8.close()
    ref = LLM(
        path, **common, num_kv_blocks=256, kv_cache_dtype="fp8", attention_backend="torch", enforce_eager=True
    )
    want = [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    ref.close()
    # Random weights give near-ties; the first 8 tokens of each prompt must agree.
    assert [g[:8] for g in got] == [w[:8] for w in want]
