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


def _codes_close(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Scales equal to their last bit or so, codes equal but for rare one-step moves (a value on
    an e4m3 rounding point; the compiler may contract a kernel's arithmetic differently)."""
    torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=0)
    qa, qb = a[0].float(), b[0].float()
    diff = (qa - qb).abs()
    one_step = torch.maximum(qb.abs() / 8, torch.full_like(diff, 2**-9)) * 1.01
    assert (diff <= one_step).all()
    assert (diff > 0).float().mean() <= 1e-3


@pytest.mark.parametrize("m", [1, 16, 300])
def test_fused_rms_norm_fp8_matches_norm_then_quantization_on_gpu(m: int) -> None:
    import kernels.triton as kt

    x = torch.randn(m, 4096, device="cuda")  # a row-parallel layer's fp32 sum
    residual = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    q, scale, new_residual = kt.rms_norm_fp8(x, weight, 1e-5, residual)
    normed, residual_unfused = kt.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, residual_unfused)
    _codes_close((q, scale), quantize_fp8_rows(normed))
    q_ref, scale_ref, _ = reference.rms_norm_fp8(x, weight, 1e-5, residual)
    _codes_close((q, scale), (q_ref, scale_ref))


@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("row_block", [16384, 4096])  # one block; two passes of 4,096
def test_fused_silu_and_mul_fp8_matches_silu_then_quantization_on_gpu(m: int, row_block: int) -> None:
    import kernels.triton as kt

    x = torch.randn(m, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 3
    fused = kt.silu_and_mul_fp8(x, row_block=row_block)
    _codes_close(fused, quantize_fp8_rows(kt.silu_and_mul(x)))
    _codes_close(fused, reference.silu_and_mul_fp8(x))


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 16])
def test_fp8_skinny_gemm_with_split_k_on_gpu(split_k: int, m: int) -> None:
    """The decode graphs' W8A8 GEMM at the 8B down shape: against the twin, the same bits on
    every call (split-K adds its planes in a fixed order), counters back at zero."""
    import importlib

    from kernels.triton.skinny_gemm import SkinnyConfig, skinny_gemm

    skinny = importlib.import_module("kernels.triton.skinny_gemm")
    xq, xs = reference.quantize_fp8_rows(torch.randn(m, 14336, device="cuda"))
    wq, ws = quantize_weight_fp8(torch.randn(4096, 14336, device="cuda") / 64)
    cfg = SkinnyConfig(block_n=32, block_k=512, num_warps=4, num_stages=4, split_k=split_k)
    out = skinny_gemm(xq, wq, torch.float32, cfg, scale=ws, x_scale=xs)
    expected = reference.linear(xq, wq, torch.float32, scale=ws, x_scale=xs)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    for _ in range(3):
        assert torch.equal(skinny_gemm(xq, wq, torch.float32, cfg, scale=ws, x_scale=xs), out)
    if split_k > 1:
        assert not skinny._WORKSPACES.by_device[out.device][1].any()


def test_an_8b_shaped_fp8_checkpoint_runs_as_the_on_the_fly_fp8_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`llmesh quantize`'s writer on the Llama-3.1-8B shape (dummy bf16 weights, written from
    memory, ~8 GB on disk): loaded back (compressed-tensors detected from config.json) it holds
    the on-the-fly FP8 model's weights and scales bit for bit, gives its greedy tokens, and its
    batch-1 decode step takes the same time (the two engines timed in turns). Run with -s."""
    import json
    import time

    from benchmarks.gpu import SHAPES, time_greedy, write_config
    from llmesh import LLM, SamplingParams
    from worker_svc.loader import load_model
    from worker_svc.models.fp8_writer import hf_named_tensors, write_fp8_checkpoint

    cfg_dir = write_config(str(tmp_path), "cfg", SHAPES["llama-3.1-8b"])
    t = time.perf_counter()
    bf16, _ = load_model(cfg_dir, dtype=torch.bfloat16, device="cuda", load_format="dummy")
    shapes = {n: tuple(w.shape) for n, w in hf_named_tensors(bf16)}
    config = json.loads(open(f"{cfg_dir}/config.json").read())
    ckpt = str(tmp_path / "fp8")
    report = write_fp8_checkpoint(hf_named_tensors(bf16), shapes, config, ckpt, progress=False)
    # The opt-in quality recipe (docs/benchmarks.md): the first and last layers' down_proj kept.
    edge = [f"model.layers.{i}.mlp.down_proj" for i in (0, config["num_hidden_layers"] - 1)]
    ckpt_edge = str(tmp_path / "fp8_edge")
    write_fp8_checkpoint(hf_named_tensors(bf16), shapes, config, ckpt_edge, ignore=edge, progress=False)
    del bf16
    torch.cuda.empty_cache()
    took = time.perf_counter() - t
    print(f"\nwrote {report.quantized} FP8 weights, {report.bytes_out / 1e9:.2f} GB, in {took:.1f} s")
    engine = dict(dtype="bfloat16", max_model_len=2048, max_num_seqs=8, num_kv_blocks=512)
    t = time.perf_counter()
    fly = LLM(cfg_dir, load_format="dummy", quantization="fp8", **engine)
    t_fly = time.perf_counter() - t
    t = time.perf_counter()
    loaded = LLM(ckpt, **engine)
    print(f"engines built: on the fly {t_fly:.1f} s, from the checkpoint {time.perf_counter() - t:.1f} s")
    kept = LLM(ckpt_edge, **engine)
    a, b = (dict(e.engine.runner.model.named_buffers()) for e in (fly, loaded))
    pa, pb = (dict(e.engine.runner.model.named_parameters()) for e in (fly, loaded))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k.endswith("weight_scale"))
    assert all(torch.equal(pa[k].view(torch.uint8), pb[k].view(torch.uint8)) for k in pa)

    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": [1000 + (i * 37 + j * 11) % 30000 for j in range(20 + 50 * i)]} for i in range(4)
    ]
    greedy = [
        [o.outputs[0].token_ids for o in e.generate(prompts, sp, use_tqdm=False)] for e in (fly, loaded)
    ]
    same = sum(x == y for x, y in zip(*greedy, strict=True))
    print(f"greedy: {same}/{len(prompts)} prompts give the same 32 tokens")

    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    n = 128
    engines = {"on the fly": fly, "checkpoint": loaded, "checkpoint, edge down_proj kept": kept}
    steps: dict[str, list[float]] = {k: [] for k in engines}
    for e in engines.values():
        time_greedy(e, prompt, n + 1)
    for _ in range(3):  # in turns, so clock or thermal drift hits all alike
        for label, e in engines.items():
            steps[label].append((time_greedy(e, prompt, n + 1) - time_greedy(e, prompt, 1)) / n)
    best = {k: min(v) * 1e3 for k, v in steps.items()}
    print("batch-1 decode step: " + ", ".join(f"{k} {v:.3f} ms" for k, v in best.items()))
    assert greedy[0] == greedy[1]
    assert best["checkpoint"] <= 1.05 * best["on the fly"]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize(
    "cfg",
    [(32, 512, 4, 4, 1), (64, 256, 4, 4, 1), (128, 256, 8, 3, 1), (32, 512, 4, 4, 2), (32, 256, 4, 3, 1)],
    ids=["n32", "n64", "n128", "split2", "bf16-cand"],
)
def test_gated_skinny_gemm_is_the_gemm_then_silu_and_mul_on_gpu(fp8: bool, m: int, cfg: tuple) -> None:
    """The decode MLP's gate|up GEMM with SiLU·mul in its epilogue, at the 8B shape, against the
    GEMM then SiLU·mul's kernel (and, for FP8, then the quantization the down projection takes):
    the same bits, with the candidate tiles the decode graphs choose from."""
    import kernels.triton as kt
    from kernels.triton.skinny_gemm import SkinnyConfig, skinny_gemm

    if not fp8 and m > 16:
        pytest.skip("bf16 layers take the skinny GEMM up to 16 rows (SKINNY_MAX_ROWS)")
    n, k, warps, stages, split = cfg
    config = SkinnyConfig(block_n=n, block_k=k, num_warps=warps, num_stages=stages, split_k=split)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * 14336, 4096, device="cuda", dtype=torch.bfloat16) / 64
    if fp8:
        xq, xs = quantize_fp8_rows(x)
        wq, ws = quantize_weight_fp8(w)
        fused, parts = skinny_gemm(
            xq, wq, torch.bfloat16, config, scale=ws, x_scale=xs, gated=True, row_amax=True
        )
        plain = skinny_gemm(xq, wq, torch.bfloat16, config, scale=ws, x_scale=xs)
        q, qs = quantize_fp8_rows(fused, partial_amax=parts)
        want_q, want_s = kt.silu_and_mul_fp8(plain)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(qs, want_s)
    else:
        fused = skinny_gemm(x, w, None, config, gated=True)
        plain = skinny_gemm(x, w, None, config)
    assert fused.shape == (m, 14336)
    assert torch.equal(fused, kt.silu_and_mul(plain))
