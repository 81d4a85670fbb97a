"""Tensor parallelism's arithmetic on one GPU: how long greedy text stays equal to size 1's.

    python3 benchmarks/tp_arithmetic.py [--model llama-3.1-8b] [--prompts 48] [--tp 2]

TP N changes where a bf16 model rounds, not what it computes: a column-parallel GEMM
(q|k|v, gate|up, lm_head) is the same dot products over N narrower weights, and a
row-parallel one (o_proj, down_proj) is N partial products over K/N summed in fp32. Both can
be run in one process over size 1's weights, so TP N's numerics can be studied on one GPU
(the attention, split by heads, computes each head as size 1 does). This builds a fresh engine
(dummy weights, bf16, CUDA graphs, cuBLAS GEMMs) per arithmetic:

* `size1`: the code as it is at size 1;
* `size1-bf16-out`: size 1 with the row-parallel output rounded to bf16 before the residual
  add (the behaviour before the fp32 hand-off: one more rounding per projection than TP N);
* `tpN`: TP N's arithmetic, emulated as above.

Each generates 64 greedy tokens for `--prompts` prompts with 8 candidate logprobs. Every pair
is compared under `benchmarks/gpu.py`'s tie rule, with the mean position of the first
divergence (64 when none). Random weights give flat distributions, so near ties come within a
few tokens whatever the arithmetic: the mean first divergence is the figure that separates
arithmetics, the PASS/FAIL line is a draw. With --time, size 1's batch-1 and batch-16 decode
steps and a 16 x 1,024-token prefill are timed for both size 1 variants.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import worker_svc.models.llama as llama_mod  # noqa: E402
import worker_svc.models.parallel_layers as pl  # noqa: E402
from benchmarks.decode_gemm_check import PROMPT_LENS, step_ms  # noqa: E402
from benchmarks.gpu import (  # noqa: E402
    SHAPES,
    add_workload_args,
    compare_greedy,
    engine_settings,
    greedy_outputs,
    write_config,
)

TOKENS = 64


class Arithmetic:
    """Which arithmetic the patched layers run (set before an engine is built: graphs freeze it)."""

    mode = "size1"
    parts = 2


_row_forward = pl.RowParallelLinear.forward
_column_forward = pl.ShardedLinear.forward
_logits = pl.vocab_parallel_logits


def _chunks(n: int) -> list[tuple[int, int]]:
    step = -(-n // Arithmetic.parts)
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def row_forward(self: pl.RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    if Arithmetic.mode == "size1":
        return _row_forward(self, x)
    if Arithmetic.mode == "size1-bf16-out":
        return F.linear(x, self.weight, self.bias)
    out = sum(pl.linear_fp32_out(x[..., a:b], self.weight[:, a:b]) for a, b in _chunks(x.shape[-1]))
    return out if self.bias is None else out + self.bias


def column_forward(self: pl.ShardedLinear, x: torch.Tensor) -> torch.Tensor:
    if not Arithmetic.mode.startswith("tp"):
        return _column_forward(self, x)
    out = torch.cat([F.linear(x, self.weight[a:b]) for a, b in _chunks(self.weight.shape[0])], dim=-1)
    return out if self.bias is None else out + self.bias


def logits(hidden: torch.Tensor, head: pl.VocabParallelEmbedding) -> torch.Tensor | None:
    if not Arithmetic.mode.startswith("tp"):
        return _logits(hidden, head)
    n = hidden.shape[0]
    rows = pl.logits_rows(n)
    if rows != n:
        hidden = F.pad(hidden, (0, 0, 0, rows - n))
    full = torch.cat([F.linear(hidden, head.weight[a:b]) for a, b in _chunks(head.weight.shape[0])], dim=-1)
    return full[:n, : head.vocab_size].float()


def prefill_ms(llm, salt: int) -> float:
    """16 new 1,024-token prompts (no prefix-cache hits), one output token each."""
    from llmesh import SamplingParams

    prompts = [{"prompt_token_ids": [(salt + 13 * i + j) % 100_000 for j in range(1024)]} for i in range(16)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--tp", type=int, default=2, help="the size whose arithmetic is emulated")
    ap.add_argument("--tie-tol", type=float, default=0.125)
    ap.add_argument("--time", action="store_true", help="also time size 1's two variants")
    ap.add_argument("--smoke", action="store_true", help="make test: parse, then skip without CUDA")
    args = ap.parse_args(argv)
    if args.smoke:  # make test (tests/benchmarks): the engines are GPU work of minutes, even on a GPU
        print("smoke: arguments parsed; the engines (bf16, CUDA graphs) skipped")
        return 0
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    args.max_num_seqs = min(args.max_num_seqs, 64)
    Arithmetic.parts = args.tp
    pl.RowParallelLinear.forward = row_forward  # type: ignore[method-assign]
    pl.ShardedLinear.forward = column_forward  # type: ignore[method-assign]
    llama_mod.vocab_parallel_logits = logits  # type: ignore[assignment]
    from llmesh import LLM

    path = write_config(tempfile.mkdtemp(), args.model, SHAPES[args.model])
    prompts = [
        list(range(100 + 7 * i, 100 + 7 * i + PROMPT_LENS[i % len(PROMPT_LENS)] + i // len(PROMPT_LENS)))
        for i in range(args.prompts)
    ]
    outs = {}
    for mode in ("size1", "size1-bf16-out", f"tp{args.tp}"):
        Arithmetic.mode = mode
        t0 = time.perf_counter()
        llm = LLM(path, **{**engine_settings(args), "decode_gemm": "cublas", "gpu_memory_utilization": 0.5})
        try:
            outs[mode] = greedy_outputs(llm, prompts, TOKENS)
            timing = ""
            if args.time and mode.startswith("size1"):
                pre = min(prefill_ms(llm, 5000 * k + 7) for k in range(4))
                timing = f"decode step batch 1 {step_ms(llm, 1):.3f} ms, batch 16 {step_ms(llm, 16):.3f} ms, "
                timing += f"prefill 16 x 1024 {pre:.1f} ms; "
        finally:
            llm.engine.close()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        print(f"{mode}: {timing}{time.perf_counter() - t0:.0f} s", flush=True)
    modes = list(outs)
    print("| reference | test | mean first divergence | prompts over the rule | largest gap | verdict |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for i, ref in enumerate(modes):
        for test in modes[i + 1 :]:
            ok, notes, _ = compare_greedy(outs[ref], outs[test], args.tie_tol)
            firsts = [int(n.split()[2]) if n.startswith("differ") else TOKENS for n in notes]
            gaps = [float(n.split("gap ")[1].split(":")[0]) for n in notes if "gap " in n]
            over = sum(g > args.tie_tol for g in gaps)
            print(
                f"| {ref} | {test} | {sum(firsts) / len(firsts):.1f} | {over} of {len(notes)} | "
                f"{max(gaps, default=0.0):.3f} | {'PASS' if ok else 'FAIL'} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
