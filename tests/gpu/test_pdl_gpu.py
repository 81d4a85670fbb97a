"""Programmatic dependent launch (`kernels.triton.pdl_enabled`) changes when a kernel starts, never
what it computes: a decode layer's chain of Triton kernels, captured in a CUDA graph with PDL and
replayed, gives the bits the same chain gives launched plainly (LLMESH_PDL=0)."""

from __future__ import annotations

import pytest
import torch

import kernels.triton as kt
from kernels.triton.skinny_gemm import SkinnyConfig

pytestmark = pytest.mark.gpu

HIDDEN, INTER = 1024, 2816


def _layers(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, device="cuda", generator=g) * cols**-0.5).to(torch.bfloat16)

    return [
        {
            "norm1": torch.rand(HIDDEN, device="cuda", generator=g).to(torch.bfloat16) + 0.5,
            "qkv": w(3 * HIDDEN, HIDDEN),
            "o": w(HIDDEN, HIDDEN),
            "norm2": torch.rand(HIDDEN, device="cuda", generator=g).to(torch.bfloat16) + 0.5,
            "gate_up": w(2 * INTER, HIDDEN),
            "down": w(HIDDEN, INTER),
        }
        for _ in range(n)
    ]


def _forward(x: torch.Tensor, layers: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """A decode layer's kernels in their order (attention left out: the qkv GEMM's first third
    stands for its output), every GEMM through the skinny kernel, o and down split over K."""
    plain, split = SkinnyConfig(block_n=64, block_k=256), SkinnyConfig(block_n=32, block_k=256, split_k=2)
    residual = x
    h = x
    for layer in layers:
        h, residual = kt.rms_norm(h, layer["norm1"], 1e-6, residual)
        qkv = kt.skinny_gemm(h, layer["qkv"], config=plain)
        attn = qkv[:, :HIDDEN].contiguous()
        h = kt.skinny_gemm(attn, layer["o"], torch.float32, split)
        h, residual = kt.rms_norm(h, layer["norm2"], 1e-6, residual)
        act = kt.silu_and_mul(kt.skinny_gemm(h, layer["gate_up"], config=plain))
        h = kt.skinny_gemm(act, layer["down"], torch.float32, split)
    return h + residual


def _forward_norms_in_gemms(x: torch.Tensor, layers: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The same chain with the residual norms in the GEMMs (LlamaForCausalLM's decode graphs in
    bf16): each GEMM reads what the one before wrote in its epilogue (the stream, h * g and the
    squares' parts), so every read of the grid before must wait for it."""
    plain, split = SkinnyConfig(block_n=64, block_k=256), SkinnyConfig(block_n=32, block_k=256, split_k=2)
    stream, scaled, squares = x, None, None
    for i, layer in enumerate(layers):
        if scaled is None:
            qkv = kt.skinny_gemm(kt.rms_norm(stream, layer["norm1"], 1e-6)[0], layer["qkv"], config=plain)
        else:
            qkv = kt.skinny_gemm(scaled, layer["qkv"], config=plain, norm_parts=squares, eps=1e-6)
        attn = qkv[:, :HIDDEN].contiguous()
        stream, scaled, squares = kt.skinny_gemm(
            attn, layer["o"], config=split, residual=stream, norm_weight=layer["norm2"]
        )
        act = kt.skinny_gemm(scaled, layer["gate_up"], config=plain, gated=True, norm_parts=squares, eps=1e-6)
        if i + 1 < len(layers):
            stream, scaled, squares = kt.skinny_gemm(
                act, layer["down"], config=split, residual=stream, norm_weight=layers[i + 1]["norm1"]
            )
        else:
            stream = kt.skinny_gemm(act, layer["down"], config=split, residual=stream)
    return stream


@pytest.mark.parametrize("fold", [False, True], ids=["norm-kernels", "norms-in-gemms"])
@pytest.mark.parametrize("rows", [1, 16])
def test_graph_with_pdl_gives_the_plain_launches_bits(rows: int, fold: bool, monkeypatch) -> None:
    if not kt.pdl_enabled(torch.device("cuda")):
        pytest.skip("programmatic dependent launch is off (LLMESH_PDL=0) or needs sm90+")
    layers = _layers(4)
    forward = _forward_norms_in_gemms if fold else _forward
    inputs = [torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(3)]

    monkeypatch.setenv("LLMESH_PDL", "0")
    assert not kt.pdl_enabled(torch.device("cuda"))
    expected = [forward(x, layers) for x in inputs]
    monkeypatch.delenv("LLMESH_PDL")

    static = inputs[0].clone()
    forward(static, layers)  # compile, and make split-K's workspace before the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward(static, layers)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(static, layers)
    for _ in range(3):  # replays back to back, each input twice
        for x, want in zip(inputs, expected, strict=True):
            static.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
    # Eager launches with PDL too.
    for x, want in zip(inputs, expected, strict=True):
        assert torch.equal(forward(x, layers), want)


@pytest.mark.parametrize(("fp8", "ctx"), [(True, 8192), (True, 32768), (False, 32768)])
def test_decode_rotating_q_starts_early_and_sees_the_newest_token(fp8: bool, ctx: int, monkeypatch) -> None:
    """qkv GEMM -> cache write (k only) -> decode attention rotating q (`q_rotary`), at the 8B's
    heads, in a graph with PDL: the attention walks the older tiles while the cache write runs,
    and still reads the key and value that write puts in the newest slot on each replay. The
    bits are the plain launches' of the path before (the cache write rotating q). An fp8 cache
    at 32k splits its 1,024-token segments between each program's warps too (`warp_split`)."""
    from kernels.triton import paged_decode as pd
    from tests.unit.kernels import make_paged_batch, rope_cache

    if not kt.pdl_enabled(torch.device("cuda")):
        pytest.skip("programmatic dependent launch is off (LLMESH_PDL=0) or needs sm90+")
    heads, kv_heads, d = 32, 8, 128
    torch.manual_seed(0)
    b = make_paged_batch(
        [(1, ctx)], num_heads=heads, num_kv_heads=kv_heads, head_dim=d, block_size=16,
        dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    scales = torch.tensor([0.05, 0.05, 20.0, 20.0], device="cuda") if fp8 else None
    fp8_cache = (b.kv_cache.float() / 0.05).to(torch.float8_e4m3fn)
    caches = [fp8_cache.clone() if fp8 else b.kv_cache.clone() for _ in range(2)]
    positions = b.meta.seq_lens.to(torch.int64) - 1
    cos_sin = rope_cache(ctx + 16, d).cuda()
    rows = (heads + 2 * kv_heads) * d
    w = [(torch.randn(rows, HIDDEN, device="cuda") / 32).to(torch.bfloat16) for _ in caches]
    assert pd.rotates_q(b.q, cos_sin) and b.meta.is_pure_decode
    planned, _ = pd.plan_decode(b.meta, kv_heads, d, fp8, b.q.device)
    assert planned.warp_split == (fp8 and ctx == 32768 and pd._DECODE_WARP_SPLIT)

    def forward(x: torch.Tensor, early: bool) -> list[torch.Tensor]:
        outs = []
        for weight, cache in zip(w, caches, strict=True):
            qkv = kt.skinny_gemm(x, weight, config=SkinnyConfig(block_n=64, block_k=256))
            q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
            q, k, v = q.view(1, heads, d), k.view(1, kv_heads, d), v.view(1, kv_heads, d)
            slots = b.meta.slot_mapping
            kt.rotary_and_write_kv(positions, q, k, v, cos_sin, cache, slots, scales, rotate_q=not early)
            out = torch.empty(1, heads, d, device="cuda", dtype=torch.bfloat16)
            rotary = (positions, cos_sin) if early else None
            outs.append(
                pd.paged_decode(
                    q, cache, b.meta, d**-0.5, out, num_splits=32, kv_scale=scales, q_rotary=rotary
                )
            )
        return outs

    inputs = [torch.randn(1, HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(3)]
    monkeypatch.setenv("LLMESH_PDL", "0")
    expected = [forward(x, early=False) for x in inputs]
    monkeypatch.delenv("LLMESH_PDL")
    static = inputs[0].clone()
    forward(static, early=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = forward(static, early=True)
    for _ in range(2):
        for x, want in zip(inputs, expected, strict=True):
            static.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            for got, ref in zip(outs, want, strict=True):
                assert torch.equal(got, ref)
