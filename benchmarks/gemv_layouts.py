"""M-row GEMMs of decode shapes: `linear(x, W)` against `mm(x, W^T stored K-major)`, in CUDA graphs.

    python3 benchmarks/gemv_layouts.py     # ~30 s on an H100
    python3 benchmarks/gemv_layouts.py --smoke   # one tiny shape on the CPU, wall-clock timed (make test)

Each cell rotates over enough weight copies (>= 200 MB) that L2 never holds them; GB/s is weight
bytes over time, to read against the D2D copy bandwidth of `benchmarks/gpu.py`.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# (in features, out features) per rank: Llama-3.1-8B at TP 1 and 2, Llama-3.1-70B at TP 2.
SHAPES = {
    "8b.qkv": (4096, 6144),
    "8b.o": (4096, 4096),
    "8b.gate_up": (4096, 28672),
    "8b.down": (14336, 4096),
    "8b.tp2.qkv": (4096, 3072),
    "8b.tp2.o": (2048, 4096),
    "70b.tp2.qkv": (8192, 5120),
    "70b.tp2.o": (4096, 8192),
    "70b.tp2.gate_up": (8192, 28672),
    "70b.tp2.down": (14336, 8192),
}


def per_call_us(fn, reps: int = 12, device: str = "cuda") -> float:
    for _ in range(2):
        fn()
    if device == "cpu":  # --smoke: no graphs, no events; a wall-clock mean
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def rotating(op, x: torch.Tensor, weights: list[torch.Tensor]):
    """A call of `op(x, w)` that takes the next weight copy each time (so graphs unroll over them)."""
    turn = [0]

    def call() -> None:
        op(x, weights[turn[0] % len(weights)])
        turn[0] += 1

    return call


SMOKE_SHAPES = {"tiny": (64, 96)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="one tiny shape on the CPU (checks the code runs)")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    shapes, ms, min_bytes = (SMOKE_SHAPES, (1, 4), 0) if args.smoke else (SHAPES, (1, 4, 16, 64), 200e6)
    print("| shape | M | linear us | GB/s | mm(K-major) us | GB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (k, n) in shapes.items():
        copies = max(2, int(min_bytes // (k * n * 2)) + 1)
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        k_major = [w.t().contiguous() for w in weights]
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            a = per_call_us(rotating(F.linear, x, weights), device=device)
            b = per_call_us(rotating(torch.mm, x, k_major), device=device)
            gb = k * n * 2 / 1e3
            print(f"| {name} | {m} | {a:.1f} | {gb / a:.0f} | {b:.1f} | {gb / b:.0f} |", flush=True)
        del weights, k_major


if __name__ == "__main__":
    main()
