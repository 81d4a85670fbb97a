"""What one step would cost on a GPU: the null worker's cost model (`null_worker.py --cost-model`).

    python benchmarks/step_cost.py [--cost-model h100-8b]    # the model's step times, a table
    python benchmarks/step_cost.py --smoke                   # the same (make test)

A step computes prefill chunks (`tokens` new tokens after `start` tokens already in the cache)
and decodes `batch` sequences (one token each). `StepCost.seconds` says how long an H100 running
Llama-3.1-8B in bf16 (llmesh's own kernels, as measured in docs/benchmarks.md and issue 31)
takes for it, so a null worker that waits that long before answering a plan behaves, towards the
scheduler and the router, like a GPU worker: routing and scale-out measured with 8-64 simulated
workers on one host. Nothing here is part of the product.

The model, in seconds (n = a chunk's tokens, s = its start, B = sequences decoded):

    prefill = a + sum over chunks of (b * n + c * n * (2 * s + n))     (0 without prefill chunks)
    decode  = d0 + d1 * (B - 1)                                         (0 when B = 0)
    step    = prefill + decode

`n * (2s + n)` = (s + n)^2 - s^2 is the chunk's share of a causal prompt's n^2 attention pairs
(times 2), so a prompt costs the same whether it is computed in one chunk or many; for one
whole prompt of N tokens the prefill term is a + b N + c N^2.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    a: float  # seconds per step that computes any prefill chunk
    b: float  # seconds per prefill token (the GEMMs: compute-bound)
    c: float  # seconds per prefill token per context token (causal attention), see the module doc
    d0: float  # seconds of a decode step of one sequence
    d1: float  # seconds per further sequence in a decode step

    def prefill_seconds(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Prefill chunks as (start, tokens): `tokens` uncached tokens after `start` in the cache."""
        total, any_chunk = 0.0, False
        for start, tokens in chunks:
            if tokens > 0:
                any_chunk = True
                total += self.b * tokens + self.c * tokens * (2 * start + tokens)
        return self.a + total if any_chunk else 0.0

    def decode_seconds(self, batch: int) -> float:
        return self.d0 + self.d1 * (batch - 1) if batch > 0 else 0.0

    def seconds(self, chunks: Iterable[tuple[int, int]], batch: int) -> float:
        return self.prefill_seconds(chunks) + self.decode_seconds(batch)


# Llama-3.1-8B shape, bf16, one H100 80GB HBM3 (llmesh's kernels, CUDA graphs for decode).
#
# Prefill, from issue 31's "prefill of one prompt: 4k / 32k / 64k / 120k tokens: 116 ms / 1.60 s /
# 4.78 s / 13.77 s" (one prompt of N tokens: a + b N + c N^2, i.e. T/N = a/N + b + c N):
#   c = (4.78/65536 - 1.60/32768) / 32768 = 7.36e-10 s per token per context token (the 32k and
#       64k points, where attention dominates; ~405-520 TFLOP/s of causal attention),
#   b = 1.60/32768 - c * 32768 = 24.7 us per token (16 GFLOP/token at ~650 TFLOP/s, 85 % of the
#       measured 763 TFLOP/s bf16 matmul peak of docs/benchmarks.md's "GPU (H100)"),
#   a = 0.116 - b * 4096 - c * 4096^2 = 2.4 ms per step (launches, lm_head, sampler).
#   Then 4k -> 116 ms, 32k -> 1.60 s, 64k -> 4.78 s (exact), 120k -> 13.6 s (measured 13.77 s,
#   -1.5 %), 1k -> 28 ms (docs: 26.2 ms, eager, "Rotary + KV write in one kernel").
# Decode:
#   d0 = 6.05 ms: batch-1 ms/token, in-process, docs/benchmarks.md "One executor per rank, one
#       step loop (issue 29)" (the step's GPU work is 6.35 ms in "GPU (H100)", its floor 5.08 ms).
#   d1 = 37 us per further sequence, from the uniform workload of the same run: 256 requests
#       (prompts 128-1024, outputs 128-512: 146,520 prompt / 81,068 output tokens, "GPU (H100)"),
#       8,275 out tok/s -> 9.80 s. Its prefill by the formula above is ~3.7 s (b * 146,520 = 3.6 s,
#       attention 0.07 s, a per 8k-token step), leaving ~6.1 s for ~505 decode steps (522 steps in
#       all, "GPU (H100)") carrying ~80,800 tokens: 505 * d0 = 3.05 s, and the other 3.0 s over
#       ~80,300 extra sequence-steps = 37 us. So a step of 256 decodes is ~15.5 ms (weights
#       5 ms + KV reads + 256 tokens of GEMMs). `uniform_throughput` below replays that workload
#       through the model as a check (tests/benchmarks/test_step_cost.py).
H100_8B = StepCost(a=2.4e-3, b=24.7e-6, c=7.36e-10, d0=6.05e-3, d1=37e-6)

COST_MODELS: dict[str, StepCost | None] = {"none": None, "h100-8b": H100_8B}


def uniform_throughput(
    cost: StepCost,
    num_requests: int = 256,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    seed: int = 0,
) -> tuple[float, int]:
    """Out tok/s and steps of gpu_mesh.py's uniform workload (prompts 128-1024, outputs 128-512,
    all sent at once) replayed through `cost` with a plain chunked-prefill planner: decodes
    first, then prefill chunks within the token budget."""
    rng = random.Random(seed)
    waiting = [[rng.randint(128, 1024), 0, rng.randint(128, 512)] for _ in range(num_requests)]
    running: list[list[int]] = []  # [prompt tokens, tokens computed, tokens left to sample]
    elapsed, steps, out = 0.0, 0, 0
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            running.append(waiting.pop(0))
        budget, chunks, sampled = max_num_batched_tokens, [], []
        decodes = [seq for seq in running if seq[1] >= seq[0]][:budget]
        budget -= len(decodes)
        for seq in running:
            if seq[1] < seq[0] and budget > 0:
                n = min(seq[0] - seq[1], budget)
                chunks.append((seq[1], n))
                budget -= n
                seq[1] += n
                if seq[1] >= seq[0]:  # the prompt's end samples the first token
                    sampled.append(seq)
        elapsed += cost.seconds(chunks, len(decodes))
        steps += 1
        for seq in decodes + sampled:
            seq[2] -= 1
            out += 1
        running = [seq for seq in running if seq[2] > 0]
    return out / elapsed if elapsed else 0.0, steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cost-model", choices=[k for k, v in COST_MODELS.items() if v], default="h100-8b")
    ap.add_argument("--smoke", action="store_true", help="the same table (make test)")
    args = ap.parse_args(argv)
    cost = COST_MODELS[args.cost_model]
    assert cost is not None
    print(f"{args.cost_model}: one prompt's prefill (one chunk)")
    for n in (128, 1024, 4096, 32768, 65536, 120000):
        print(f"{n:>9,} tokens {1000 * cost.prefill_seconds([(0, n)]):>10.1f} ms")
    print("decode step by batch")
    for b in (1, 8, 32, 64, 128, 256, 512):
        t = cost.decode_seconds(b)
        print(f"{b:>9} seqs {1000 * t:>10.2f} ms  {b / t:>8,.0f} tok/s")
    tok_s, steps = uniform_throughput(cost)
    print(f"uniform workload (256 requests, gpu_mesh.py's shape): {tok_s:,.0f} out tok/s in {steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
