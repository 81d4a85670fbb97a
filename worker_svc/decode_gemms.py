"""Which GEMM each linear layer's decode graphs run: cuBLAS or a Triton skinny GEMM, timed at start.

A decode step of a few sequences only streams the weights through its GEMMs. On an H100 the
skinny GEMM (`kernels.triton.skinny_gemm`) streamed them 1-15 % faster than cuBLAS on 11 of
12 Llama decode shapes and lost 1 % on the other (`python3 benchmarks/skinny_gemm.py`). Which
config wins depends on the shape and the GPU, so each distinct (weight shape, dtype, output
dtype) is timed before the decode graphs are captured: cuBLAS against a few configs, in a CUDA
graph that runs the op over the model's own layers of that shape in turn (so the weights come
from memory, not from L2, as in a real step). The fastest is used by every layer of that
shape; cuBLAS stays unless a config beats it by MIN_GAIN. FP8 layers are timed a second time at
WIDE_ROWS rows for a second choice, which the decode graphs of 17 to WIDE_ROWS rows run. The
vocabulary's matrix (the lm_head, or a tied model's embedding; kept in the model's dtype) is timed
as a shape of its own: the logits of a decode step of few rows (`vocab_parallel_logits`) take its
config. An untied model's embedding has the head's shape and joins its group (a lookup never
reads the config). Only a large matrix is timed (HEAD_MIN_BYTES): the head's GEMM is launched
eagerly, after the step's graph, and a small model's step is bound by the host, whose Triton
launch costs more than cuBLAS's (H100, Qwen2.5-0.5B's 260 MiB head: batch-1 step 1.11 -> 1.37 ms;
Llama 3.1 8B's 1,002 MiB: 5.75 -> 5.70 ms).

The choices are kept in a JSON file in the model cache (`decode_gemms.json`), keyed by GPU,
torch and Triton versions and shape, and reused: a timing is noisy where two candidates are
close, and a worker that chose differently at each start would round differently, so greedy
text could change across restarts at near ties. Every worker of a host makes the same choice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kernels import reference
from worker_svc.models.fp8 import Fp8Rows, fp8_linear, fp8_skinny_linear
from worker_svc.models.parallel_layers import (
    SKINNY_WIDE_ROWS,
    ShardedLinear,
    VocabParallelEmbedding,
    linear_fp32_out,
)

if TYPE_CHECKING:
    from kernels.triton.skinny_gemm import SkinnyConfig

log = logging.getLogger(__name__)

MIN_GAIN = 0.02  # a config must beat cuBLAS by this much: smaller wins are within the noise
CUBLAS = "cublas"
CACHE_FILE = "decode_gemms.json"
_ROWS = 1  # timed at batch 1 (the sweep's best config was the same from 1 to 16 rows)
# FP8 layers are timed a second time at WIDE_ROWS rows, every candidate against `_scaled_mm`, for
# the decode graphs of 17 to WIDE_ROWS rows: CUTLASS's rowwise FP8 GEMM streams the weights at a
# fraction of the bandwidth at few rows (H100, 8B shapes, 32-64 rows: the best skinny config took
# 0.61-0.94x its time), the best config at 64 rows is not the best at one (a deep batch-1 one
# does not fit 64 rows' tiles), and a ShareGPT-shaped run spends over a third of its decode steps
# at 17-64 sequences. Timing at the range's top also proves that the config fits all of it.
WIDE_ROWS = SKINNY_WIDE_ROWS
_WIDE = f"@{WIDE_ROWS}"  # suffix of the times (and cache keys) of that second timing
HEAD_MIN_BYTES = 512 << 20  # a vocabulary's matrix smaller than this keeps cuBLAS (module doc)

# (layers of one shape, output in fp32) -> {candidate name: microseconds per call}
Timer = Callable[[list[ShardedLinear], bool], dict[str, float]]
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def candidates(fp8: bool | None = None) -> dict[str, object]:
    """The configs timed for a weight dtype: for bf16/fp16 (fp8=False) those that won a cell of
    benchmarks/skinny_gemm.py's 24-config sweep on an H100; for FP8 weights (fp8=True) tiles
    of the same bytes (twice as deep: a byte an element) and split-K ones, whose extra programs
    keep more loads in flight on the shapes of few output columns (o_proj, down: 4,096). The
    six-stage one won those two shapes at batch 1 on an H100 (8.5 against 9.3 us, 22.9 against
    24.2: docs/benchmarks.md, "FP8 batch 1 by kernel").
    None: both lists (every name a cached choice may hold)."""
    from kernels.triton.skinny_gemm import SkinnyConfig

    wide = [
        SkinnyConfig(block_n=32, block_k=512, num_warps=4, num_stages=3),
        SkinnyConfig(block_n=32, block_k=512, num_warps=4, num_stages=4),
        SkinnyConfig(block_n=64, block_k=256, num_warps=4, num_stages=4),
    ]
    byte = [
        SkinnyConfig(block_n=32, block_k=512, num_warps=4, num_stages=4),
        SkinnyConfig(block_n=32, block_k=512, num_warps=4, num_stages=6),
        SkinnyConfig(block_n=32, block_k=1024, num_warps=4, num_stages=3),
        SkinnyConfig(block_n=64, block_k=512, num_warps=4, num_stages=4),
        SkinnyConfig(block_n=16, block_k=1024, num_warps=4, num_stages=4),
        # Won qkv and gate_up at 64 rows on an H100 (11.7 / 46.7 us against `_scaled_mm`'s 14.7
        # / 50.7), where the configs above lost to it.
        SkinnyConfig(block_n=64, block_k=256, num_warps=4, num_stages=4),
        SkinnyConfig(block_n=128, block_k=256, num_warps=8, num_stages=3),
        SkinnyConfig(block_n=32, block_k=512, num_warps=4, num_stages=4, split_k=2),
        SkinnyConfig(block_n=32, block_k=1024, num_warps=4, num_stages=3, split_k=2),
        SkinnyConfig(block_n=32, block_k=512, num_warps=4, num_stages=4, split_k=4),
    ]
    configs = wide if fp8 is False else byte if fp8 else wide + byte
    return {str(c): c for c in configs}


def choose_decode_gemms(
    models: Iterable[nn.Module],
    device: torch.device,
    cache_dir: str | None = None,
    timer: Timer | None = None,
) -> list[str]:
    """Set `decode_gemm` on every bf16/fp16/fp8 linear layer of `models` (and `decode_gemm_wide`
    on the FP8 ones); one line per shape.

    Off CUDA nothing is chosen (unless a `timer` is given: the tests' way in). Choices found in
    `cache_dir`'s file are reused; new ones are timed and added to it."""
    if device.type != "cuda" and timer is None:
        return []
    timer = timer or _time_candidates
    t0 = time.perf_counter()
    groups: dict[tuple, list[ShardedLinear]] = {}
    for model in models:
        for layer in model.modules():
            timed = isinstance(layer, ShardedLinear) or (
                isinstance(layer, VocabParallelEmbedding)
                and layer.weight.numel() * layer.weight.element_size() >= HEAD_MIN_BYTES
            )
            if timed and layer.weight.dtype in _WEIGHT_DTYPES:
                fp32_out = isinstance(layer, ShardedLinear) and layer.out_fp32()
                groups.setdefault((tuple(layer.weight.shape), layer.weight.dtype, fp32_out), []).append(layer)
    if not groups:
        return []
    path = os.path.join(cache_dir, CACHE_FILE) if cache_dir else None
    known = _read(path)
    configs = candidates()
    lines, learned = [], False
    for (shape, dtype, fp32_out), layers in groups.items():
        key = _key(device, shape, dtype, fp32_out)
        wide_timed = _fp8(layers[0])  # FP8 layers get a second choice
        name, wide = known.get(key), known.get(key + _WIDE) if wide_timed else None
        how = "cached"
        # Not chosen yet, or a config since retired (or a cache from before the second timing,
        # whose FP8 entries lack it): time the shape. A valid cached choice is kept as it is.
        if not _valid(name, configs) or (wide_timed and not _valid(wide, configs)):
            times = timer(layers, fp32_out)
            if not _valid(name, configs):
                name = known[key] = _fastest(times)
            if wide_timed:
                wide = known[key + _WIDE] = _fastest(times, _WIDE)
            learned, how = True, _times_text(times)
        for layer in layers:
            layer.decode_gemm = None if name == CUBLAS else configs[name]  # type: ignore[assignment]
            if isinstance(layer, ShardedLinear):
                layer.decode_gemm_wide = None if wide in (None, CUBLAS) else configs[wide]  # type: ignore[assignment]
        out = "fp32" if fp32_out else str(dtype).removeprefix("torch.")
        upto = f"; 17-{WIDE_ROWS} rows: {wide}" if wide_timed else ""
        lines.append(f"{shape[1]}->{shape[0]} {out} x{len(layers)}: {name}{upto} ({how})")
    if learned and path:
        _write(path, known)
    log.info("decode GEMMs chosen in %.1f s: %s", time.perf_counter() - t0, "; ".join(lines))
    return lines


def _fp8(layer: ShardedLinear | VocabParallelEmbedding) -> bool:
    """Whether the layer's weight is FP8 (a head never is: it stays in the model's dtype)."""
    return getattr(layer, "weight_scale", None) is not None


def _valid(name: str | None, configs: dict[str, object]) -> bool:
    return name == CUBLAS or name in configs


def _fastest(times: dict[str, float], suffix: str = "") -> str:
    """The fastest of the times taken at that suffix's rows (none: batch 1), or CUBLAS where
    none beats the library by MIN_GAIN (or the library was not timed there)."""
    library_us = times.get(CUBLAS + suffix)
    if library_us is None:
        return CUBLAS
    best, best_us = CUBLAS, library_us
    for timed, us in times.items():
        name, at, rows = timed.partition("@")
        if name == CUBLAS or at + rows != suffix:
            continue
        if us < library_us * (1 - MIN_GAIN) and us < best_us:
            best, best_us = name, us
    return best


def _times_text(times: dict[str, float]) -> str:
    return ", ".join(f"{name} {us:.1f} us" for name, us in times.items())


def _key(device: torch.device, shape: tuple, dtype: torch.dtype, fp32_out: bool) -> str:
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    weights = str(dtype).removeprefix("torch.")
    out = "float32" if fp32_out else "bfloat16" if dtype == torch.float8_e4m3fn else weights
    versions = f"torch {torch.__version__}|triton {triton.__version__}"
    return f"{gpu}|{versions}|{shape[1]}->{shape[0]}|{weights} -> {out}"


def _read(path: str | None) -> dict[str, str]:
    if not path:
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # unreadable or corrupt: time again, and rewrite it
        log.warning("decode GEMM choices in %s ignored (%s)", path, e)
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _write(path: str, choices: dict[str, str]) -> None:
    """Atomically (a temp file renamed over it): workers starting together never read half a file."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".decode_gemms.")
        with os.fdopen(fd, "w") as f:
            json.dump(choices, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: choose again at the next start
        log.warning("decode GEMM choices not saved to %s (%s)", path, e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _time_candidates(
    layers: list[ShardedLinear | VocabParallelEmbedding], fp32_out: bool
) -> dict[str, float]:
    """Microseconds per call of cuBLAS and of each candidate that runs on this GPU.

    FP8 layers: "cuBLAS" is their eager path (`_scaled_mm`), a skinny GEMM the same math on its
    FP8 tensor-core tiles, both over rows quantized beforehand (most layers get them so from
    the fused norm / SiLU·mul; o_proj's quantization kernel costs both the same)."""
    from kernels.triton.skinny_gemm import skinny_gemm

    weight = layers[0].weight
    n, k = weight.shape
    fp8 = _fp8(layers[0])
    x = torch.randn(_ROWS, k, dtype=torch.bfloat16 if fp8 else weight.dtype, device=weight.device)
    rows = Fp8Rows(*reference.quantize_fp8_rows(x), x.dtype) if fp8 else None
    out_dtype = torch.float32 if fp32_out else None

    def cublas(layer: ShardedLinear | VocabParallelEmbedding) -> None:
        if _fp8(layer):
            fp8_linear(rows, layer.weight, layer.weight_scale, None, out_dtype or x.dtype)
        else:
            linear_fp32_out(x, layer.weight) if fp32_out else F.linear(x, layer.weight)

    def skinny(layer: ShardedLinear | VocabParallelEmbedding, cfg: SkinnyConfig) -> None:
        if _fp8(layer):
            fp8_skinny_linear(rows, layer.weight, layer.weight_scale, out_dtype or x.dtype, cfg)
        else:
            skinny_gemm(x, layer.weight, out_dtype, cfg)

    times = {CUBLAS: _time_us(cublas, layers)}
    for name, cfg in candidates(fp8).items():
        try:
            times[name] = _time_us(lambda layer, c=cfg: skinny(layer, c), layers)
        except Exception as e:  # noqa: BLE001 - a config this GPU cannot run (shared memory...)
            log.debug("skinny GEMM %s refused for %s: %s", name, (n, k), e)
    if fp8:  # every candidate and the library again at WIDE_ROWS rows (see WIDE_ROWS)
        x = torch.randn(WIDE_ROWS, k, dtype=x.dtype, device=x.device)
        rows = Fp8Rows(*reference.quantize_fp8_rows(x), x.dtype)
        times[CUBLAS + _WIDE] = _time_us(cublas, layers)
        for name, cfg in candidates(fp8).items():
            try:
                times[name + _WIDE] = _time_us(lambda layer, c=cfg: skinny(layer, c), layers)
            except Exception as e:  # noqa: BLE001 - its tiles of WIDE_ROWS rows do not fit
                log.debug("skinny GEMM %s refused at %d rows for %s: %s", name, WIDE_ROWS, (n, k), e)
    return times


def _time_us(op: Callable[[ShardedLinear], object], layers: list[ShardedLinear]) -> float:
    """Microseconds per call of `op`, in a CUDA graph that calls it once per layer (median of 5)."""
    reps = max(len(layers), 4)
    for layer in layers[:2]:  # compile / pick the algorithm outside the capture
        op(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            op(layers[i % len(layers)])
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
