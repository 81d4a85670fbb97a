"""The skinny decode GEMMs against cuBLAS in the engine: greedy output (bf16 tie rule) and step time.

    python3 benchmarks/decode_gemm_check.py [--model llama-3.1-8b] [--rounds 2] [--tensor-parallel-size 2]

Builds a fresh engine per (round, size, decode_gemm), alternating `cublas` and `auto` (dummy
weights, bf16), and in each:
* times a decode step at batch 1, 4 and 16 (128-token prompts, 128 steps: the step is the
  difference between 129 and 1 generated tokens, over 128);
* in the first round, generates 64 greedy tokens for 12 prompts with 8 candidate logprobs.
Then compares the greedy outputs:
* size 1: `auto` against `cublas` (what the skinny GEMM alone changes);
* with --tensor-parallel-size N > 1 also TP N against size 1, once with each decode_gemm (so a
  divergence of TP N can be told apart from one of the GEMMs).
A prompt passes when the tokens are equal or first differ at a near tie of the reference
(`benchmarks/gpu.py`'s rule, --tie-tol nats). Every engine's line is printed as it finishes;
the exit code is 1 if a comparison failed.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu import (  # noqa: E402
    SHAPES,
    add_workload_args,
    compare_greedy,
    greedy_outputs,
    make_llm,
    write_config,
)

PROMPT_LENS = [17, 130, 431, 777, 9, 64, 200, 333, 50, 600, 25, 90]
BATCHES = (1, 4, 16)


def step_ms(llm, batch: int, steps: int = 128) -> float:
    """Milliseconds per decode step of `batch` sequences of 128-token prompts."""
    from llmesh import SamplingParams

    prompts = [{"prompt_token_ids": list(range(1000 + 7 * i, 1128 + 7 * i))} for i in range(batch)]

    def run(tokens: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    run(steps + 1)  # warm: every prompt's prefix is cached from here on
    return (min(run(steps + 1) for _ in range(2)) - min(run(1) for _ in range(3))) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of timings (0: none)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--tie-tol", type=float, default=0.125)
    ap.add_argument("--smoke", action="store_true", help="make test: parse, then skip without CUDA")
    args = ap.parse_args(argv)
    if args.smoke:  # make test (tests/benchmarks): the engines are GPU work of minutes, even on a GPU
        print("smoke: arguments parsed; the engines (cuBLAS vs skinny GEMM, CUDA) skipped")
        return 0
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    tp = args.tensor_parallel_size
    args.tensor_parallel_size = 1
    args.max_num_seqs = min(args.max_num_seqs, 16)
    path = write_config(tempfile.mkdtemp(), args.model, SHAPES[args.model])
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate(PROMPT_LENS)]
    outs = {}
    for r in range(max(args.rounds, 1)):
        for size in [1] + ([tp] if tp > 1 else []):
            for gemm in ("cublas", "auto"):
                t0 = time.perf_counter()
                llm = make_llm(
                    path, args, tensor_parallel_size=size, decode_gemm=gemm, gpu_memory_utilization=0.5
                )
                try:
                    if r == 0:
                        outs[(gemm, size)] = greedy_outputs(llm, prompts, args.tokens)
                    steps = {b: step_ms(llm, b) for b in BATCHES} if args.rounds else {}
                finally:
                    llm.engine.close()
                    del llm
                    gc.collect()
                    torch.cuda.empty_cache()
                timing = "  ".join(f"batch {b} {ms:.3f} ms" for b, ms in steps.items())
                took = time.perf_counter() - t0
                print(f"round {r}, size {size}, {gemm:6s}: {timing} ({took:.0f} s)", flush=True)
    failed = False

    def show(label: str, ref, test) -> None:
        nonlocal failed
        ok, notes, max_dlp = compare_greedy(ref, test, args.tie_tol)
        failed |= not ok
        diverged = [n for n in notes if n.startswith("differ")]
        print(
            f"{label}: {'PASS' if ok else 'FAIL'}, max |logprob diff| {max_dlp:.3f}, "
            f"{len(diverged)} of {len(notes)} prompts diverge: {'; '.join(diverged)}",
            flush=True,
        )

    show("size 1, auto vs cublas", outs[("cublas", 1)], outs[("auto", 1)])
    if tp > 1:
        show(f"cublas, TP {tp} vs size 1", outs[("cublas", 1)], outs[("cublas", tp)])
        show(f"auto, TP {tp} vs size 1", outs[("auto", 1)], outs[("auto", tp)])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
