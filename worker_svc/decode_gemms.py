"""Which GEMM each linear layer's decode graphs run: cuBLAS or a Triton skinny GEMM, timed at start.

A decode step of a few sequences only streams the weights through its GEMMs. On an H100 the
skinny GEMM (`kernels.triton.skinny_gemm`) streamed them 1-15 % faster than cuBLAS on 11 of
12 Llama decode shapes and lost 1 % on the other (`python3 benchmarks/skinny_gemm.py`). Which
config wins depends on the shape and the GPU, so each distinct (weight shape, dtype, output
dtype) is timed once at start, before the decode graphs are captured: cuBLAS against a few
configs, in a CUDA graph that runs the op over the model's own layers of that shape in turn
(so the weights come from memory, not from L2, as in a real step). The fastest is used by
every layer of that shape; cuBLAS stays unless a config beats it by MIN_GAIN.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.models.parallel_layers import RowParallelLinear, ShardedLinear, linear_fp32_out

log = logging.getLogger(__name__)

MIN_GAIN = 0.02  # a config must beat cuBLAS by this much: smaller wins are within the noise
_ROWS = 1  # timed at batch 1 (the sweep's best config was the same from 1 to 16 rows)


def _candidates() -> list:
    """The configs that won a cell of benchmarks/skinny_gemm.py's 24-config sweep on an H100."""
    from kernels.triton.skinny_gemm import SkinnyConfig

    return [
        SkinnyConfig(block_n=32, block_k=512, num_warps=4, num_stages=3),
        SkinnyConfig(block_n=32, block_k=512, num_warps=4, num_stages=4),
        SkinnyConfig(block_n=64, block_k=256, num_warps=4, num_stages=4),
    ]


def choose_decode_gemms(models: Iterable[nn.Module], device: torch.device) -> list[str]:
    """Set `decode_gemm` on every linear layer of `models` (CUDA only); one line per shape."""
    if device.type != "cuda":
        return []
    t0 = time.perf_counter()
    groups: dict[tuple, list[ShardedLinear]] = {}
    for model in models:
        for layer in model.modules():
            if isinstance(layer, ShardedLinear) and layer.weight.dtype in (torch.bfloat16, torch.float16):
                fp32_out = isinstance(layer, RowParallelLinear) and layer.tp.size > 1
                key = (tuple(layer.weight.shape), layer.weight.dtype, fp32_out)
                groups.setdefault(key, []).append(layer)
    lines = []
    for (shape, dtype, fp32_out), layers in groups.items():
        choice, line = _choose(layers, shape, dtype, fp32_out, device)
        for layer in layers:
            layer.decode_gemm = choice
        lines.append(line)
    if lines:
        log.info("decode GEMMs chosen in %.1f s: %s", time.perf_counter() - t0, "; ".join(lines))
    return lines


def _choose(
    layers: list[ShardedLinear], shape: tuple, dtype: torch.dtype, fp32_out: bool, device: torch.device
) -> tuple[object | None, str]:
    from kernels.triton.skinny_gemm import skinny_gemm

    n, k = shape
    x = torch.randn(_ROWS, k, dtype=dtype, device=device)
    weights = [layer.weight for layer in layers]
    out_dtype = torch.float32 if fp32_out else None

    def cublas(w: torch.Tensor) -> None:
        linear_fp32_out(x, w) if fp32_out else F.linear(x, w)

    best, best_us = None, _time_us(cublas, weights)
    cublas_us = best_us
    for cfg in _candidates():
        try:
            us = _time_us(lambda w, c=cfg: skinny_gemm(x, w, out_dtype, c), weights)
        except Exception as e:  # noqa: BLE001 - a config this GPU cannot run (shared memory...)
            log.debug("skinny GEMM %s refused for %s: %s", cfg, shape, e)
            continue
        if us < cublas_us * (1 - MIN_GAIN) and us < best_us:
            best, best_us = cfg, us
    what = "cuBLAS" if best is None else f"skinny {best}"
    out = "fp32" if fp32_out else str(dtype).removeprefix("torch.")
    line = f"{k}->{n} {out} x{len(layers)}: {what} {best_us:.1f} us (cuBLAS {cublas_us:.1f})"
    return best, line


def _time_us(op: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
    """Microseconds per call of `op`, in a CUDA graph that calls it once per weight (median of 5)."""
    reps = max(len(weights), 4)
    for w in weights[:2]:  # compile / pick the algorithm outside the capture
        op(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            op(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    del graph
    return statistics.median(times)
