"""FP8 on the GPU: the quantization kernel bit for bit against its twin, the layer against the
dequantized product, and an engine that serves with fp8 weights (cuBLAS/CUTLASS rowwise FP8)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from kernels.triton.fp8_quant import quantize_fp8_rows
from worker_svc.models.fp8 import fp8_linear, quantize_weight_fp8

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m,k", [(1, 4096), (37, 14336), (512, 4096)])
def test_quantize_fp8_rows_matches_twin_on_gpu(m: int, k: int) -> None:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 4
    q, s = quantize_fp8_rows(x)
    q_ref, s_ref = reference.quantize_fp8_rows(x)
    assert torch.equal(s, s_ref)
    # The kernel's rounding is the twin's, but the compiler may contract x / scale differently
    # from torch's kernel: a value on an e4m3 rounding point may land one code away, rarely.
    diff = (q.float() - q_ref.float()).abs()
    one_step = torch.maximum(q_ref.float().abs() / 8, torch.full_like(diff, 2**-9)) * 1.01
    assert (diff <= one_step).all()
    assert (diff > 0).float().mean() <= 1e-4


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_fp8_linear_matches_the_dequantized_product_on_gpu(out_dtype: torch.dtype, m: int) -> None:
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_weight_fp8(torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) * 0.02)
    out = fp8_linear(x, wq, ws.reshape(1, -1), None, out_dtype)
    xq, xs = reference.quantize_fp8_rows(x)
    expected = F.linear(xq.float() * xs, wq.float() * ws[:, None])
    assert out.dtype == out_dtype
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_engine_serves_with_fp8_weights(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from llmesh import LLM, SamplingParams
    from tests.helpers.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", hidden_size=256, intermediate_size=512)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 130)]
    llm = LLM(path, dtype="bfloat16", quantization="fp8", max_model_len=512, num_kv_blocks=128)
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert all(len(t) == 16 for t in a)
    assert a == b  # graphs (decodes) and eager steps (prefills) run the same FP8 math each time
