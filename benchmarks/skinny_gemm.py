"""Decode GEMMs: the Triton skinny GEMM (`kernels.triton.skinny_gemm`) against cuBLAS.

    python3 benchmarks/skinny_gemm.py [--ms 1,2,4,8,16] [--shapes 8b.o,8b.tp2.o] [--quick]
    python3 benchmarks/skinny_gemm.py --fp8 [--ms 1,16] [--shapes 8b.qkv,8b.o,8b.gate_up,8b.down]

For every decode shape (Llama-3.1-8B at TP 1 and 2, 70B at TP 2) and row count M, times
cuBLAS (`F.linear`; for the row-parallel shapes at TP 2 also `mm(..., out_dtype=float32)`,
what those layers call) and every skinny-GEMM config of the sweep, in CUDA graphs over
rotating weight copies (L2 never holds the matrix), and prints the best config per cell with
its bandwidth (weight bytes / time; read it against the D2D copy bandwidth of
`benchmarks/gpu.py`). Each best config is also checked against the fp32 twin.

--fp8: the W8A8 decode GEMMs (FP8 weights with per-channel scales, rows already quantized per
token, as the fused RMSNorm / SiLU·mul hand them over): `torch._scaled_mm` (the eager path)
against FP8_CONFIGS (split-K among them), each cell the median of 5 replays of a graph over
rotating weight copies, with the device's copy bandwidth (bytes read + written) measured first
in the same process, so every GB/s reads against it.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gemv_layouts import SHAPES, SMOKE_SHAPES, per_call_us, rotating  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.triton.skinny_gemm import SkinnyConfig, skinny_gemm  # noqa: E402

# gemv_layouts' shapes plus the 8B MLP at TP 2 and the lm_heads; (in features, out features) per rank.
ALL_SHAPES = {
    **SHAPES,
    "8b.tp2.gate_up": (4096, 14336),
    "8b.tp2.down": (7168, 4096),
    "8b.lm_head": (4096, 128256),
    "8b.tp2.lm_head": (4096, 64128),
    "70b.tp2.lm_head": (8192, 64128),
}
ROW_PARALLEL = {"8b.tp2.o", "8b.tp2.down", "70b.tp2.o", "70b.tp2.down"}  # fp32 out at TP 2


def sweep(quick: bool) -> list[SkinnyConfig]:
    if quick:
        return [SkinnyConfig(), SkinnyConfig(block_n=64, block_k=256, num_warps=8)]
    grid = itertools.product((16, 32, 64), (256, 512), (4, 8), (3, 4))
    return [SkinnyConfig(n, k, w, s) for n, k, w, s in grid]


# FP8 tiles: a byte an element, so deeper K tiles or more programs (split-K) for the same
# bytes in flight as the bf16 configs.
FP8_CONFIGS = [
    SkinnyConfig(n, k, w, s, split_k=sk)
    for n, k, w, s, sk in [
        (16, 1024, 4, 4, 1),
        (16, 2048, 4, 3, 1),
        (32, 512, 4, 4, 1),
        (32, 1024, 4, 3, 1),
        (32, 1024, 4, 4, 1),
        (32, 1024, 8, 3, 1),
        (64, 512, 4, 4, 1),
        (64, 1024, 8, 3, 1),
        (16, 1024, 4, 4, 2),
        (32, 512, 4, 4, 2),
        (32, 1024, 4, 3, 2),
        (32, 512, 4, 4, 4),
        (32, 1024, 4, 3, 4),
        (64, 512, 4, 4, 2),
        (64, 512, 4, 4, 4),
        (32, 256, 4, 4, 8),
    ]
]


def _rotate(items: list, op):
    """A call of `op(*item)` that takes the next of `items` each time (graphs unroll over them)."""
    turn = [0]

    def call() -> None:
        op(*items[turn[0] % len(items)])
        turn[0] += 1

    return call


def _median_us(fn, device: str, calls: int = 24, replays: int = 5) -> float:
    """Microseconds per call: the median over `replays` of a graph of `calls` calls (wall clock
    on the CPU, for the smoke run)."""
    import statistics
    import time

    fn()
    if device == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def fp8_main(args: argparse.Namespace, device: str) -> int:
    from worker_svc.models.fp8 import quantize_weight_fp8

    smoke = device == "cpu"
    configs = [SkinnyConfig(32, 32), SkinnyConfig(32, 32, split_k=2)] if smoke else FP8_CONFIGS
    copy_gbs = 0.0
    if not smoke:  # as benchmarks/gpu.py measures it: events around each copy, no graph (a
        # copy captured in a graph becomes a memcpy node, which read 2.76 TB/s on an H200 whose
        # kernel copy reads 4.26)
        src = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        copy_gbs = 2 * src.numel() * 2 / 1e3 / sorted(times)[len(times) // 2]
        del src, dst
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreted)"
    print(f"{gpu}: copy {copy_gbs:.0f} GB/s (read + written); {len(configs)} FP8 configs")
    print(
        "| shape | M | out | _scaled_mm us | GB/s | skinny us | GB/s | of copy | skinny / _scaled_mm | best |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    failures = 0
    rows_out = []
    for name in args.shapes.split(","):
        k, n = ALL_SHAPES[name]
        copies = 2 if smoke else max(2, int(400e6 // (k * n)) + 1)
        weights = [
            quantize_weight_fp8(torch.randn(n, k, device=device, dtype=torch.bfloat16) / 64)
            for _ in range(copies)
        ]
        w_scales = [(w, s.reshape(1, -1)) for w, s in weights]
        # o_proj and down hand their sum on in fp32 (the row-parallel layers); q|k|v, gate|up bf16.
        out_dtype = torch.float32 if name.endswith((".o", ".down")) else torch.bfloat16
        for m in (int(v) for v in args.ms.split(",")):
            xq, xs = reference.quantize_fp8_rows(torch.randn(m, k, device=device, dtype=torch.bfloat16))
            gemm_dtype = torch.bfloat16 if smoke else out_dtype  # the CPU's _scaled_mm: bf16 out

            def scaled_mm(w: torch.Tensor, s: torch.Tensor, xq=xq, xs=xs, d=gemm_dtype) -> None:
                torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s, out_dtype=d)

            t_ref = _median_us(_rotate(w_scales, scaled_mm), device)
            best, best_t, times = None, float("inf"), {}
            for cfg in configs:

                def skinny(w: torch.Tensor, s: torch.Tensor, xq=xq, xs=xs, d=out_dtype, c=cfg) -> None:
                    skinny_gemm(xq, w, d, c, scale=s, x_scale=xs)

                try:
                    t = _median_us(_rotate(weights, skinny), device)
                except OutOfResources:
                    continue
                times[str(cfg)] = t
                if t < best_t:
                    best, best_t = cfg, t
            w, s = weights[0]
            got = skinny_gemm(xq, w, out_dtype, best, scale=s, x_scale=xs).float()
            want = reference.linear(xq, w, out_dtype, scale=s, x_scale=xs).float()
            ok = torch.allclose(got, want, atol=2e-2, rtol=2e-2)
            failures += not ok
            gb = k * n / 1e3
            of_copy = f"{gb / best_t / copy_gbs:.0%}" if copy_gbs else "-"
            tag = "fp32" if out_dtype == torch.float32 else "bf16"
            print(
                f"| {name} | {m} | {tag} | {t_ref:.1f} | {gb / t_ref:.0f} | {best_t:.1f} | "
                f"{gb / best_t:.0f} | {of_copy} | {best_t / t_ref:.2f} | {best}{'' if ok else ' MISMATCH'} |",
                flush=True,
            )
            rows_out.append((name, m, times))
        del weights, w_scales
        if device == "cuda":
            torch.cuda.empty_cache()
    print("every config, us per call:")
    for name, m, times in rows_out:
        print(
            f"  {name} M={m}: "
            + ", ".join(f"{c} {t:.1f}" for c, t in sorted(times.items(), key=lambda i: i[1]))
        )
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--shapes", default=",".join(ALL_SHAPES))
    ap.add_argument("--quick", action="store_true", help="two configs instead of the sweep")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, the kernel interpreted")
    ap.add_argument("--fp8", action="store_true", help="the W8A8 GEMMs: FP8 weights and rows")
    args = ap.parse_args(argv)
    device, min_bytes = "cuda", 200e6
    if args.smoke:  # Triton's interpreter on CPU tensors (kernels/triton dual_jit): checks, not speed
        device, min_bytes, args.ms, args.shapes, args.quick = "cpu", 0, "1,4", "tiny", True
        ALL_SHAPES["tiny"] = SMOKE_SHAPES["tiny"]
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    if args.fp8:
        if args.shapes == ap.get_default("shapes") and not args.smoke:
            args.shapes = "8b.qkv,8b.o,8b.gate_up,8b.down"
        return fp8_main(args, device)
    configs = sweep(args.quick)[:1] if args.smoke else sweep(args.quick)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreted)"
    print(f"{gpu}, {len(configs)} configs (+ the plain-sum body at M = 1)")
    print("| shape | M | out | cuBLAS us | GB/s | skinny us | GB/s | skinny / cuBLAS | best config |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    failures = 0
    for name in args.shapes.split(","):
        k, n = ALL_SHAPES[name]
        gb = k * n * 2 / 1e3  # weight bytes, in units that make GB/s of bytes / us
        copies = max(2, int(min_bytes // (k * n * 2)) + 1)
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / 64 for _ in range(copies)]
        outs = [torch.bfloat16] + ([torch.float32] if name in ROW_PARALLEL else [])
        for m, out_dtype in itertools.product((int(v) for v in args.ms.split(",")), outs):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            if out_dtype == torch.float32:
                fp32_mm = rotating(lambda a, w: torch.mm(a, w.t(), out_dtype=torch.float32), x, weights)
                t_cublas = per_call_us(fp32_mm, device=device)
            else:
                t_cublas = per_call_us(rotating(F.linear, x, weights), device=device)
            cands = configs + ([SkinnyConfig(c.block_n, c.block_k, c.num_warps, c.num_stages, dot=False)
                                for c in configs] if m == 1 else [])  # fmt: skip
            best, best_t = None, float("inf")
            for cfg in cands:
                call = rotating(lambda a, w, c=cfg, o=out_dtype: skinny_gemm(a, w, o, c), x, weights)
                try:
                    t = per_call_us(call, reps=1 if args.smoke else 12, device=device)
                except OutOfResources:  # too many stages of too large a tile for shared memory
                    continue
                if t < best_t:
                    best, best_t = cfg, t
            got = skinny_gemm(x, weights[0], out_dtype, best).float()
            want = reference.linear(x, weights[0], out_dtype).float()
            ok = torch.allclose(got, want, atol=2e-2, rtol=2e-2)
            failures += not ok
            tag = "fp32" if out_dtype == torch.float32 else "bf16"
            print(
                f"| {name} | {m} | {tag} | {t_cublas:.1f} | {gb / t_cublas:.0f} | {best_t:.1f} | "
                f"{gb / best_t:.0f} | {best_t / t_cublas:.2f} | {best}{'' if ok else ' MISMATCH'} |",
                flush=True,
            )
        del weights
        if device == "cuda":
            torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
