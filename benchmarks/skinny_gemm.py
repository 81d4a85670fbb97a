"""Decode GEMMs: the Triton skinny GEMM (`kernels.triton.skinny_gemm`) against cuBLAS.

    python3 benchmarks/skinny_gemm.py [--ms 1,2,4,8,16] [--shapes 8b.o,8b.tp2.o] [--quick]

For every decode shape (Llama-3.1-8B at TP 1 and 2, 70B at TP 2) and row count M, times
cuBLAS (`F.linear`; for the row-parallel shapes at TP 2 also `mm(..., out_dtype=float32)`,
what those layers call) and every skinny-GEMM config of the sweep, in CUDA graphs over
rotating weight copies (L2 never holds the matrix), and prints the best config per cell with
its bandwidth (weight bytes / time; read it against the D2D copy bandwidth of
`benchmarks/gpu.py`). Each best config is also checked against the fp32 twin.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--shapes", default=",".join(ALL_SHAPES))
    ap.add_argument("--quick", action="store_true", help="two configs instead of the sweep")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, the kernel interpreted")
    args = ap.parse_args(argv)
    device, min_bytes = "cuda", 200e6
    if args.smoke:  # Triton's interpreter on CPU tensors (kernels/triton dual_jit): checks, not speed
        device, min_bytes, args.ms, args.shapes, args.quick = "cpu", 0, "1,4", "tiny", True
        ALL_SHAPES["tiny"] = SMOKE_SHAPES["tiny"]
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
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
