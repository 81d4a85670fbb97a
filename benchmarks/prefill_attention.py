"""Long-context prefill (issue 31): the attention of long chunks alone, and one prompt end to end.

    python3 benchmarks/prefill_attention.py [--lens 16384,32768,65536,131072] [--sections peak,check,...]
    python3 benchmarks/prefill_attention.py --smoke          # tiny shapes, CPU interpreter

Four paths for the attention of long chunks (PATHS; the backend's switches): "flash", the
default (worker_svc/attention/long_prefill.py: SDPA on K/V gathered from the paged cache over
long contexts and for first chunks, the Triton prefill kernel for the other long chunks),
"flash-before" (the same before its shapes were bounded and its merge fused), "triton" (the
Triton prefill kernel for every long chunk) and "unified" (the unified paged kernel for
everything, the path before issue 31).

Sections (Llama-3.1-8B's attention: 32 query / 8 KV heads, D=128, bf16, cache block 16):

* peak: the bf16 matmul rate measured in the same run (8192^3), the ceiling every TFLOP/s
  below is compared with;
* check: each path against the twin (torch SDPA on the gathered K/V, fp32) on a whole prompt,
  on a chunk over a cached prefix and on a mixed step, as ||out - ref|| / ||ref||;
* sweep: the Triton prefill kernel's tile shapes (BLOCK_M, BLOCK_N, warps, stages[, warp
  specialisation]) at --sweep-len, one whole prompt;
* kernel: per L of --lens, each path on one causal prompt of L tokens in one call and as the
  engine runs it (chunks of --chunk tokens over the cached prefix, summed), and torch SDPA on
  contiguous K/V for scale. FLOPs = 4 * H * D * L(L+1)/2 (QK^T and PV, causal);
* plans: what a new (queries, keys) shape costs cuDNN (torch keeps its plans per thread): the
  first call of each shape of an 8k-chunked 120k prompt on a fresh thread against its second;
* parts: the flash path's pieces summed over the chunks of each of --parts-lens (one layer;
  x 32 for the 8B model): gather, the two cuDNN calls, the merge, both paths whole;
* e2e: an 8B engine (random weights, no prefix caching) per --e2e-chunks (max_num_batched_tokens)
  prefills one fresh prompt of each of --e2e-lens tokens (generate with max_tokens=1, best of
  --e2e-reps, the first printed too) per path (the first --more-chunk-paths paths only after
  the first chunk size); or the rows of --e2e-runs;
* profile (with e2e): one fresh prompt of each of --profile-lens through the default path under
  the torch profiler: GPU time by kernel category and the top kernels, against the wall.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import math
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

TARGET_FRACTION = 0.70  # issue 31: attention at >= 70 % of the measured bf16 matmul peak
# Issue 31: prefill seconds of one prompt, 32k and 120k (= 120,000: benchmarks/step_cost.py's fit).
E2E_TARGETS = {32768: 1.1, 120000: 9.5}
SWEEP = [  # (BLOCK_M, BLOCK_N, warps, stages[, warp specialisation 0/1])
    (128, 64, 8, 3),
    (128, 64, 8, 2),
    (128, 64, 4, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 32, 4, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 2),
    (256, 64, 8, 2),
]

pf_mod = importlib.import_module("kernels.triton.prefill_attention")
lp_mod = importlib.import_module("worker_svc.attention.long_prefill")

# The attention paths a prefill can take (the backend's switches: PREFILL_MIN_QUERY, LONG_ROWS).
PATHS = {  # label, PREFILL_MIN_QUERY (None: the module's), LONG_ROWS, BUCKETED
    "flash": ("SDPA (cuDNN) on gathered K/V (default)", None, "flash", True),
    "flash-before": ("SDPA, before plan reuse (own shapes, torch merge)", None, "flash", False),
    "triton": ("Triton prefill kernel", None, "triton", True),
    "unified": ("unified kernel (before)", 1 << 30, "flash", True),
}


@contextlib.contextmanager
def attention_path(key: str) -> Iterator[str]:
    """The backend's attention for long chunks set to PATHS[key] for the block; yields its label."""
    label, min_query, long_rows, bucketed = PATHS[key]
    saved = pf_mod.PREFILL_MIN_QUERY, lp_mod.LONG_ROWS, lp_mod.BUCKETED
    pf_mod.PREFILL_MIN_QUERY, lp_mod.LONG_ROWS, lp_mod.BUCKETED = min_query or saved[0], long_rows, bucketed
    try:
        yield label
    finally:
        pf_mod.PREFILL_MIN_QUERY, lp_mod.LONG_ROWS, lp_mod.BUCKETED = saved


def attend(q: torch.Tensor, cache: torch.Tensor, meta, scale: float, out: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """What `TritonPagedBackend.forward` runs after its KV write."""
    import kernels.triton as kt

    if pf_mod.use_prefill_kernel(meta):
        return lp_mod.long_prefill_attention(q, cache, meta, scale)
    return kt.paged_attention(q, cache, meta, scale, out=out)


def _meta(q_len: int, seq_len: int, block_size: int, num_blocks: int, dev: str, perm: torch.Tensor):  # type: ignore[no-untyped-def]
    from kernels.attention_metadata import AttentionMetadata

    n = -(-seq_len // block_size)
    return AttentionMetadata(
        slot_mapping=torch.zeros(q_len, dtype=torch.long, device=dev),  # unused by attention
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=dev),
        block_tables=perm[:n][None, :].to(torch.int32).contiguous(),
        max_query_len=q_len,
        max_seq_len=seq_len,
        query_lens_cpu=[q_len],
        seq_lens_cpu=[seq_len],
    )


class Case:
    """One sequence of `length` tokens in a paged cache (blocks in random order), its queries."""

    def __init__(self, length: int, args: argparse.Namespace, contiguous_blocks: bool = False) -> None:
        dev, bs = args.device, args.block_size
        self.length, self.args = length, args
        self.num_blocks = -(-length // bs)
        dtype = torch.bfloat16 if dev == "cuda" else torch.float32
        self.cache = torch.randn(
            (2, self.num_blocks, bs, args.kv_heads, args.head_dim), dtype=dtype, device=dev
        )
        self.perm = (
            torch.arange(self.num_blocks, device=dev)
            if contiguous_blocks
            else torch.randperm(self.num_blocks, device=dev)
        )
        self.q = torch.randn((length, args.heads, args.head_dim), dtype=dtype, device=dev)
        self.out = torch.empty_like(self.q)
        self.scale = args.head_dim**-0.5

    def chunk(self, start: int, end: int):  # type: ignore[no-untyped-def]
        """q, out and metadata of the chunk [start, end) over the cached prefix [0, start)."""
        meta = _meta(end - start, end, self.args.block_size, self.num_blocks, self.args.device, self.perm)
        return self.q[start:end], self.out[start:end], meta

    def flops(self, start: int = 0, end: int | None = None) -> float:
        end = self.length if end is None else end
        keys = (end * (end + 1) - start * (start + 1)) // 2  # sum over queries of keys seen
        return 4.0 * self.args.heads * self.args.head_dim * keys


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _check_paths(row, what: str, q, cache, meta, scale: float, out, ref, tol: float) -> bool:  # type: ignore[no-untyped-def]
    """One row per attention path: its relative error against the twin's `ref`; whether all pass."""
    ok = True
    for key in PATHS:
        with attention_path(key) as label:
            try:
                err = _rel_err(attend(q, cache, meta, scale, out), ref)
            except Exception as e:
                row("check", f"{label}, {what}", "ERROR", repr(e)[:160])
                ok = False
                continue
        ok &= err < tol
        row("check", f"{label}, {what}", f"{err:.1e}", f"rel. error vs twin; < {tol:g}")
    return ok


def check(args: argparse.Namespace, row) -> bool:  # type: ignore[no-untyped-def]
    from kernels import reference

    ok = True
    tol = 1e-2 if args.device == "cuda" else 1e-4
    for length, start in args.check_shapes:
        case = Case(length, args)
        q, out, meta = case.chunk(start, length)
        ref = reference.prefill_attention(q.float(), case.cache.float(), meta, case.scale)
        ok &= _check_paths(row, f"chunk {start}..{length}", q, case.cache, meta, case.scale, out, ref, tol)
        del case, ref
    # A mixed step: decodes and a short chunk beside a long chunk (the backend splits it).
    from kernels.attention_metadata import AttentionMetadata

    dev, bs = args.device, args.block_size
    seqs = args.check_mixed  # (new tokens, context after the step)
    need = [-(-s // bs) for _, s in seqs]
    perm = torch.randperm(sum(need), device=dev).to(torch.int32)
    tables = torch.zeros((len(seqs), max(need)), dtype=torch.int32, device=dev)
    for i, n in enumerate(need):
        tables[i, :n] = perm[sum(need[:i]) : sum(need[:i]) + n]
    lens = [n for n, _ in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(lens), dtype=torch.long, device=dev),
        query_start_loc=torch.tensor(
            [sum(lens[:i]) for i in range(len(seqs) + 1)], dtype=torch.int32, device=dev
        ),
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32, device=dev),
        block_tables=tables,
        max_query_len=max(lens),
        max_seq_len=max(s for _, s in seqs),
        query_lens_cpu=lens,
        seq_lens_cpu=[s for _, s in seqs],
    )
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cache = torch.randn((2, sum(need), bs, args.kv_heads, args.head_dim), dtype=dtype, device=dev)
    q = torch.randn((sum(lens), args.heads, args.head_dim), dtype=dtype, device=dev)
    scale = args.head_dim**-0.5
    ref = reference.paged_attention(q.float(), cache.float(), meta, scale)
    return _check_paths(row, f"mixed {seqs}", q, cache, meta, scale, torch.empty_like(q), ref, tol) and ok


def _time(fn, args: argparse.Namespace) -> float:  # type: ignore[no-untyped-def]
    from benchmarks.gpu import gpu_time

    if args.device != "cuda":
        return gpu_time(fn, reps=1, warmup=0)
    return gpu_time(fn, reps=args.reps, warmup=1)


def _prefill_call(case: Case, cfg=None):  # type: ignore[no-untyped-def]
    q, out, meta = case.chunk(0, case.length)
    return lambda: pf_mod.prefill_attention(q, case.cache, meta, case.scale, out=out, config=cfg)


def sweep(args: argparse.Namespace, peak: float, row) -> pf_mod.PrefillConfig | None:  # type: ignore[no-untyped-def]
    case = Case(args.sweep_len, args)
    best, best_t = None, math.inf
    for spec in args.sweep:
        cfg = pf_mod.PrefillConfig(*spec[:4], warp_specialize=bool(spec[4:] and spec[4]))
        bm, bn, w, s = spec[:4]
        label = f"{bm} x {bn}, {w} warps, {s} stages" + (", warp-specialised" if cfg.warp_specialize else "")
        try:
            t = _time(_prefill_call(case, cfg), args)
        except Exception as e:  # out of shared memory, registers: keep the rest
            row("sweep", label, "ERROR", repr(e)[:100])
            continue
        tf = case.flops() / t / 1e12
        row("sweep", label, f"{tf:.0f} TFLOP/s", f"{tf / peak:.0%} of peak")
        if t < best_t:
            best, best_t = cfg, t
    del case
    return best


def kernel(args: argparse.Namespace, peak: float, row) -> None:  # type: ignore[no-untyped-def]
    """Per length: one whole causal prompt per call, then the engine's chunks over the prefix."""
    import torch.nn.functional as F

    from benchmarks.gpu import free_cuda

    for length in args.lens:
        case = Case(length, args)
        flops = case.flops()
        section = f"attention, 1 x {length}"
        chunks = [case.chunk(s, min(s + args.chunk, length)) for s in range(0, length, args.chunk)]
        calls = {}
        for key in args.paths:
            for shape, parts in (
                ("whole prompt", [case.chunk(0, length)]),
                (f"chunks of {args.chunk}", chunks),
            ):

                def run(parts=parts, case=case) -> None:
                    for q_c, o_c, m_c in parts:
                        attend(q_c, case.cache, m_c, case.scale, o_c)

                calls[(key, shape)] = run
        if args.device == "cuda":  # SDPA on a contiguous K/V, [1, H, L, D]: the scale, no gather
            k = case.cache[0].view(-1, args.kv_heads, args.head_dim)[:length].transpose(0, 1)[None]
            v = case.cache[1].view(-1, args.kv_heads, args.head_dim)[:length].transpose(0, 1)[None]
            qt = case.q.transpose(0, 1)[None]
            calls[(None, "whole prompt, contiguous K/V")] = lambda qt=qt, k=k, v=v, case=case: (
                F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=case.scale, enable_gqa=True)
            )
        for (key, shape), fn in calls.items():
            with attention_path(key or "flash") as label:
                label = label if key else "torch SDPA (cuDNN)"
                try:
                    t = _time(fn, args)
                except Exception as e:
                    row(section, f"{label}, {shape}", "ERROR", repr(e)[:100])
                    continue
            tf = flops / t / 1e12
            met = "met" if tf / peak >= TARGET_FRACTION else "MISSED"
            verdict = f"; target >= {TARGET_FRACTION:.0%}: {met}" if key == "flash" else ""
            row(
                section,
                f"{label}, {shape}",
                f"{t * 1e3:.1f} ms",
                f"{tf:.0f} TFLOP/s = {tf / peak:.0%}{verdict}",
            )
        del case, calls, chunks
        free_cuda()


@dataclasses.dataclass
class E2ERun:
    """Rows of one attention path on an engine of `chunk`-token steps."""

    chunk: int
    path: str
    lens: list[int]
    reps: int


def e2e_runs(args: argparse.Namespace) -> list[E2ERun]:
    """--e2e-runs "chunk:path:len,len:reps;..." or, without it, the --e2e-chunks / --paths /
    --more-chunk-paths grid."""
    if args.e2e_runs:
        runs = []
        for spec in args.e2e_runs.split(";"):
            chunk, path, lens, reps = spec.split(":")
            runs.append(E2ERun(int(chunk), path, [int(x) for x in lens.split(",")], int(reps)))
        return runs
    runs = []
    for chunk in args.e2e_chunks:
        first = chunk == args.e2e_chunks[0]
        paths = args.paths if first else args.paths[: args.more_chunk_paths]
        paths = paths[:1] if args.smoke else paths  # the switch itself is the check section's
        lens = args.e2e_lens if first else args.e2e_more_lens
        runs += [E2ERun(chunk, key, lens, args.e2e_reps) for key in paths]
    return runs


def e2e(args: argparse.Namespace, row) -> None:  # type: ignore[no-untyped-def]
    """Fresh prompts through an 8B engine (random weights), per run of `e2e_runs`; runs in a row
    with the same chunk size share an engine (and its step thread's cuDNN plans: a path's first
    rep meets the shapes no earlier run built)."""
    from benchmarks.gpu import SHAPES, SMOKE_SHAPES, free_cuda, make_llm, time_greedy, write_config

    name = "llama-tiny" if args.smoke else "llama-3.1-8b"
    cfg = (SMOKE_SHAPES if args.smoke else SHAPES)[name]
    rng = random.Random(0)
    runs = e2e_runs(args)
    max_len = max(n for r in runs for n in r.lens) + 64
    short = min(1024, *(n for r in runs for n in r.lens))  # the prompt that compiles a path

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(10, cfg["vocab_size"]) for _ in range(n)]}

    groups: list[list[E2ERun]] = []
    for r in runs:
        if groups and groups[-1][0].chunk == r.chunk:
            groups[-1].append(r)
        else:
            groups.append([r])
    with tempfile.TemporaryDirectory() as root:
        path = write_config(root, name, cfg)
        for group in groups:
            chunk = group[0].chunk
            section = f"prefill, chunks of {chunk}"
            args.max_num_batched_tokens = chunk
            t0 = time.perf_counter()
            try:
                llm = make_llm(path, args, max_model_len=max_len, enable_prefix_caching=False)
                time_greedy(llm, prompt(short), 1)
            except Exception as e:
                row(section, "engine", "ERROR", repr(e)[:160])
                free_cuda()
                continue
            row(section, "engine start + a short prompt", f"{time.perf_counter() - t0:.1f} s", "")
            try:
                for run in group:
                    _e2e_run(llm, run, lambda n: prompt(short if n is None else n), section, row, args)
            finally:
                llm.close()
                del llm
                free_cuda()


def _e2e_run(llm, run: E2ERun, prompt, section: str, row, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    from benchmarks.gpu import time_greedy

    with attention_path(run.path) as label:
        try:
            time_greedy(llm, prompt(None), 1)  # compiles this path
        except Exception as e:  # keep the other paths' rows
            row(section, label, "ERROR", repr(e)[:160])
            return
        for length in run.lens:
            try:  # fresh prompts every time: no prefix to reuse
                times = [time_greedy(llm, prompt(length), 1) for _ in range(run.reps)]
            except Exception as e:
                row(section, f"{label}, {length}", "ERROR", repr(e)[:160])
                continue
            t = min(times)
            target = E2E_TARGETS.get(length)
            note = f"{length / t:,.0f} prompt tok/s"
            if len(times) > 1:  # the first meets the shapes' cuDNN plans unbuilt
                note += f"; best of {len(times)}, first {times[0]:.3f} s"
            if target is not None and run.path.startswith("flash"):
                note += f"; target <= {target} s: {'met' if t <= target else 'MISSED'}"
            row(section, f"{label}, {length} tokens", f"{t:.3f} s", note)
        if "profile" in args.sections and args.device == "cuda" and run.path == "flash":
            for length in args.profile_lens:
                try:
                    profile_prefill(llm, prompt(length), f"{label}, {length} tokens, {run.chunk}", row)
                except Exception as e:
                    traceback.print_exc()
                    row(section, f"profile {length}", "ERROR", repr(e)[:160])
            args.profile_lens = []  # once, on the first run of the default path


# Kernel-name fragments (lower case) -> the category a profile sums them under, first match wins.
KERNEL_KINDS = [
    ("attention (cuDNN / flash)", ("cudnn", "sdpa", "fmha", "flash")),
    ("attention (Triton)", ("attn", "attention")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
    ("K/V gather (index)", ("index", "gather")),
    ("norm / rotary / act (Triton)", ("rms", "norm", "rotary", "rope", "silu", "act", "fused")),
    ("copies / casts", ("copy", "memcpy", "memset", "cast", "fill")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "softmax", "lerp", "sigmoid")),
]


def _kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def profile_prefill(llm, prompt: dict, label: str, row) -> None:  # type: ignore[no-untyped-def]
    """One fresh prompt's prefill under the torch profiler (CUDA activity only: every kernel the
    step thread launches): GPU time per kernel category and the top kernels, against the wall
    time, whose remainder is the GPU idle (host time between launches and steps)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu import time_greedy

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = time_greedy(llm, prompt, 1)
    per_name: dict[str, list[float]] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = us if us is not None else getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            acc = per_name.setdefault(e.key, [0.0, 0])
            acc[0] += us / 1e6
            acc[1] += e.count
    busy = sum(t for t, _ in per_name.values())
    section = f"profile, {label}"
    row(section, "wall (under the profiler)", f"{wall:.3f} s", f"GPU busy {busy:.3f} s = {busy / wall:.0%}")
    kinds: dict[str, float] = {}
    for name, (t, _) in per_name.items():
        kinds[_kind(name)] = kinds.get(_kind(name), 0.0) + t
    for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1]):
        row(section, kind, f"{t * 1e3:.1f} ms", f"{t / busy:.1%} of GPU busy")
    for name, (t, n) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:16]:
        row(section, f"kernel {name[:90]}", f"{t * 1e3:.1f} ms", f"{n} calls, {t / busy:.1%}")


def plans(args: argparse.Namespace, row) -> None:  # type: ignore[no-untyped-def]
    """What a new (queries, keys) shape costs cuDNN: the first call of a shape on a thread
    (torch keeps cuDNN's execution plans per thread) against the second, each on a fresh thread,
    so every shape meets an empty cache."""
    import threading

    from benchmarks.gpu import sync

    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    dev = torch.device(args.device)

    def tensors(sq: int, skv: int):  # type: ignore[no-untyped-def]
        q = torch.randn((sq, h, d), dtype=torch.bfloat16, device=dev).transpose(0, 1)[None]
        k = torch.randn((skv, hkv, d), dtype=torch.bfloat16, device=dev).transpose(0, 1)[None]
        return q, k, torch.randn_like(k)

    index = torch.cuda.current_device()
    shapes = [(sq, skv, causal, *tensors(sq, skv)) for sq, skv, causal in args.plan_shapes]
    times: dict[int, list[float]] = {}

    def work() -> None:  # one fresh thread: an empty plan cache, every shape new to it
        torch.cuda.set_device(index)
        q, k, v = tensors(1024, 1024)
        cudnn(q, k, v, None, True, 0.0, True, False, scale=0.1)  # the thread's handle, first plan
        for i, (_, _, causal, q, k, v) in enumerate(shapes):
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                cudnn(q, k, v, None, True, 0.0, causal, False, scale=0.1)
                sync()
                times.setdefault(i, []).append(time.perf_counter() - t0)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    for i, (sq, skv, causal, *_) in enumerate(shapes):
        what = f"q {sq} x k {skv}" + (", causal" if causal else "")
        ts = times.get(i, [])
        if len(ts) < 3:
            row("cuDNN plans", what, "ERROR", "see the log")
            continue
        row(
            "cuDNN plans",
            what,
            f"{(ts[0] - min(ts[1:])) * 1e3:.1f} ms",
            f"first call on the thread {ts[0] * 1e3:.1f} ms, then {min(ts[1:]) * 1e3:.1f} ms",
        )
    shapes.clear()  # frees the tensors


def parts(args: argparse.Namespace, row) -> None:  # type: ignore[no-untyped-def]
    """The flash path's pieces summed over one prompt's chunks (one layer): the gather of the
    context from the paged cache, the two cuDNN calls, the logsumexp merge and the copy into
    the output; x 32 layers is their share of an 8B prefill."""
    from kernels.reference import gather_kv

    for length in args.parts_lens:
        case = Case(length, args)
        totals: dict[str, float] = {}
        for start in range(args.chunk, length, args.chunk):
            end = min(start + args.chunk, length)
            if end < lp_mod.FLASH_MIN_CONTEXT or end - start < pf_mod.PREFILL_MIN_QUERY:
                continue  # the Triton kernel's or the unified kernel's
            for name, fn in _flash_parts(case, start, end, gather_kv).items():
                totals[name] = totals.get(name, 0.0) + _time(fn, args)
        for part, t in totals.items():
            row(
                f"flash path, 1 x {length} in chunks of {args.chunk}",
                part,
                f"{t * 1e3:.2f} ms",
                f"x 32 layers = {t * 32:.3f} s",
            )
        del case


def _flash_parts(case: Case, start: int, end: int, gather_kv) -> dict:  # type: ignore[no-untyped-def]
    """Callables for each piece of the flash path on the chunk [start, end) of `case`: those of
    the path before plan reuse (gather, two cuDNN calls, torch merge, copy into the batch), the
    new pieces (padded gather, one-kernel merge) and both whole."""
    q, out, meta = case.chunk(start, end)
    bt, sc = meta.block_tables[0], case.scale
    k, v = gather_kv(case.cache, bt, end)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    o_pre, lse_pre = lp_mod._attend_with_lse(qh, kh[:, :, :start], vh[:, :, :start], False, sc)
    o_new, lse_new = lp_mod._attend_with_lse(qh, kh[:, :, start:], vh[:, :, start:], True, sc)

    def merge() -> torch.Tensor:
        w = torch.sigmoid(lse_pre - lse_new)[..., None]
        return torch.lerp(o_new.float(), o_pre.float(), w)[0].transpose(0, 1).to(q.dtype)

    o = merge()
    rows = -(-(end - start) // lp_mod.SQUARE_ALIGN) * lp_mod.SQUARE_ALIGN
    return {
        "gather": lambda: gather_kv(case.cache, bt, end),
        "cuDNN prefix": lambda: lp_mod._attend_with_lse(qh, kh[:, :, :start], vh[:, :, :start], False, sc),
        "cuDNN causal square": lambda: lp_mod._attend_with_lse(
            qh, kh[:, :, start:], vh[:, :, start:], True, sc
        ),
        "torch merge (before)": merge,
        "copy out (before)": lambda: out.copy_(o),
        "padded gather (new)": lambda: lp_mod._gather_padded(case.cache, bt, end, start + rows),
        "merge_two kernel (new)": lambda: pf_mod.merge_two(
            o_pre[0].transpose(0, 1), lse_pre[0], o_new[0].transpose(0, 1), lse_new[0], out
        ),
        "whole chunk, before": lambda: lp_mod._flash_chunk_unbucketed(q, case.cache, meta, 0, sc, None),
        "whole chunk, new": lambda: lp_mod._flash_chunk(q, case.cache, meta, 0, sc, None, out),
    }


def main(argv: list[str] | None = None) -> None:
    saved_min = pf_mod.PREFILL_MIN_QUERY, pf_mod.PREFILL_MIN_CONTEXT  # --smoke lowers them
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="peak,check,sweep,kernel,e2e")
    ap.add_argument("--lens", default="16384,32768,65536,131072")
    ap.add_argument("--chunk", type=int, default=8192, help="the engine-shaped rows' chunk size")
    ap.add_argument("--sweep-len", type=int, default=32768)
    ap.add_argument("--sweep", default=";".join(",".join(map(str, c)) for c in SWEEP))
    ap.add_argument("--e2e-lens", default="4096,32768,65536,120000")
    ap.add_argument("--e2e-reps", type=int, default=1)
    ap.add_argument(
        "--e2e-chunks", default="8192", help="max_num_batched_tokens per engine (paths: first only)"
    )
    ap.add_argument("--e2e-more-lens", default=None, help="--e2e-lens for the later chunk sizes")
    ap.add_argument(
        "--e2e-runs",
        default="",
        help='e2e rows instead of the grid: "chunk:path:len,len:reps;..." (consecutive runs of one '
        "chunk size share an engine)",
    )
    ap.add_argument("--profile-lens", default="32768", help="profile: prompts profiled (first path, chunk)")
    ap.add_argument("--parts-lens", default="32768,120000", help="parts: prompts whose flash path is split")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"attention paths of {list(PATHS)}")
    ap.add_argument(
        "--more-chunk-paths", type=int, default=1, help="paths (the first n) run at the later chunks"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--quantization", default=None, choices=["fp8"], help="the e2e engines' weights (fp8: W8A8)"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for table.txt")
    args = ap.parse_args(argv)
    args.heads, args.kv_heads, args.head_dim, args.block_size = 32, 8, 128, 16
    args.check_shapes = [(8192, 0), (12288, 8192)]  # contexts that take the new paths
    args.check_mixed = [(1, 3000), (300, 2000), (2048, 20480), (1, 500), (1024, 1024)]
    args.lens = [int(x) for x in args.lens.split(",") if x]
    args.e2e_lens = [int(x) for x in args.e2e_lens.split(",") if x]
    more = args.e2e_more_lens
    args.e2e_more_lens = [int(x) for x in more.split(",") if x] if more is not None else args.e2e_lens
    args.profile_lens = [int(x) for x in args.profile_lens.split(",") if x]
    args.parts_lens = [int(x) for x in args.parts_lens.split(",") if x]
    # (queries, keys, causal): the shapes of an 8k-chunked prompt's flash calls.
    args.plan_shapes = [
        (8192, 8192, True),
        (8192, 16384, False),
        (8192, 106496, False),
        (5312, 114688, False),
    ]
    args.e2e_chunks = [int(x) for x in args.e2e_chunks.split(",") if x]
    args.paths = [x for x in args.paths.split(",") if x]
    args.sweep = [tuple(int(x) for x in c.split(",")) for c in args.sweep.split(";") if c]
    if args.smoke:
        args.device = "cpu"
        args.heads, args.kv_heads, args.head_dim = 4, 2, 16
        args.check_shapes, args.lens, args.chunk, args.sweep_len = [(40, 16)], [32], 16, 32
        args.check_mixed = [(1, 30), (5, 20), (17, 40), (1, 9)]
        args.sweep = [(16, 16, 4, 2)]
        # On the CPU "flash-before" is "flash" (no SDPA there): make test's time.
        args.paths = [p for p in args.paths if p != "flash-before"]
        args.e2e_lens, args.e2e_reps, args.e2e_chunks = [40], 1, [32]
        args.e2e_more_lens, args.profile_lens, args.parts_lens = [40], [], []
        # The new paths at the shapes above (the engine's backend is torch's on the CPU).
        pf_mod.PREFILL_MIN_QUERY, pf_mod.PREFILL_MIN_CONTEXT = 16, 16
    # The engine settings gpu.make_llm reads (benchmarks/gpu.py's engine_settings).
    args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens = 0, 4, args.e2e_chunks[0]
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --smoke for a dry run)")
    from benchmarks.gpu import ROWS, log, matmul_ceiling, row

    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    log(f"GPU: {gpu}")
    sections = args.sections.split(",")
    t0 = time.perf_counter()
    ok = True
    try:
        peak = math.inf
        if "peak" in sections or "sweep" in sections or "kernel" in sections:
            args.matmul_n = 8192 if args.device == "cuda" else 128
            peak = matmul_ceiling(args)
        if "check" in sections:
            ok = check(args, row)
        if "sweep" in sections:
            cfg = sweep(args, peak, row)
            if cfg is not None:
                row(
                    "sweep",
                    "best",
                    f"{dataclasses.astuple(cfg)}",
                    f"default: {pf_mod.default_config(128, 4)}",
                )
        for name, fn in (("plans", plans), ("parts", parts)):  # diagnostics: the rest runs regardless
            if name in sections and args.device == "cuda":
                try:
                    fn(args, row)
                except Exception as e:
                    traceback.print_exc()
                    row(name, "ERROR", repr(e)[:160])
        if "kernel" in sections:
            kernel(args, peak, row)
        if "e2e" in sections:
            e2e(args, row)
    finally:
        row("notes", "cuDNN took GQA K/V unexpanded", str(not lp_mod._CUDNN_NEEDS_HEADS), "(long_prefill)")
        pf_mod.PREFILL_MIN_QUERY, pf_mod.PREFILL_MIN_CONTEXT = saved_min
        lines = [
            f"GPU: {gpu}; {time.perf_counter() - t0:.0f} s",
            "| section | item | value | note |",
            "| --- | --- | ---: | --- |",
        ]
        lines += [f"| {s} | {i} | {v} | {n} |" for s, i, v, n in ROWS]
        text = "\n".join(lines)
        print(text, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "prefill_table.txt"), "w") as f:
                f.write(text + "\n")
        ROWS.clear()
    if not ok:
        sys.exit("check: a kernel disagrees with its twin")


if __name__ == "__main__":
    main()
