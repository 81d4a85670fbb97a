"""Prompt outputs: what prompt logprobs and pooling (embeddings) cost against a plain prefill.

    python -m benchmarks.prompt_outputs                                  # CPU, the embedded SmolLM2
    python -m benchmarks.prompt_outputs --device cuda --model llama-3.1-8b --prompts 64 --prompt-len 512

Offline engine, --prompts prompts of --prompt-len tokens each, best of --reps runs per row:
- prefill: `max_tokens=1` (the prompt's prefill and one sampled token): the baseline;
- prompt logprobs k: the same with `prompt_logprobs=k` (lm-evaluation-harness's scoring request:
  a log-softmax over the vocabulary at every prompt position, eager steps, no prefix hit);
- embed: `LLM.embed` (a pooling request: the prefill, last-token pooling, nothing sampled).
Prompt tokens per second and the time against the baseline.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from typing import Any


def _best(run, reps: int) -> float:
    run()  # warm-up (graphs, kernels, allocator)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best


def rows_for(llm: Any, prompts: list[list[int]], k: int, reps: int) -> list[tuple[str, float]]:
    from llmesh import SamplingParams
    from llmesh.pooling import PoolingParams

    def gen(**kw: Any):
        return lambda: llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=1, **kw), use_tqdm=False
        )

    return [
        ("prefill (max_tokens=1)", _best(gen(), reps)),
        (f"prompt logprobs k={k} (max_tokens=1)", _best(gen(prompt_logprobs=k), reps)),
        (
            "embed (last-token pooling)",
            _best(lambda: llm.embed(prompts, PoolingParams(), use_tqdm=False), reps),
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2", help="smollm2 (embedded) or llama-3.1-8b (dummy weights)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--k", type=int, default=1, help="prompt_logprobs k (top alternatives per position)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="2 prompts of 24 tokens, one rep (make test)")
    args = ap.parse_args()
    if args.smoke:
        args.prompts, args.prompt_len, args.reps = 2, 24, 1

    from llmesh import LLM
    from services.model_files import resolve_model

    # No prefix cache: every rep computes its prompts (the requests measured here never hit it).
    kw: dict[str, Any] = dict(
        device=args.device, max_num_seqs=max(args.prompts, 2), enable_prefix_caching=False
    )
    tmp = None
    if args.model == "smollm2":
        path = resolve_model(None, None)
    else:
        from benchmarks.gpu import SHAPES, write_config

        tmp = tempfile.mkdtemp()
        path = write_config(tmp, args.model, SHAPES[args.model])
        kw.update(load_format="dummy", dtype="bfloat16" if args.device == "cuda" else "float32")
    try:
        llm = LLM(path, **kw)
        vocab = llm.engine.runner.model_config.vocab_size
        # Distinct prompts (no shared prefix), ids away from the special tokens.
        prompts = [
            [100 + (i * 131 + j * 7) % (vocab - 200) for j in range(args.prompt_len)]
            for i in range(args.prompts)
        ]
        rows = rows_for(llm, prompts, args.k, args.reps)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    tokens = args.prompts * args.prompt_len
    base = rows[0][1]
    width = max(len(r[0]) for r in rows)
    name = "smollm2" if args.model == "smollm2" else args.model
    print(
        f"prompt outputs, device={args.device}, model={name}, "
        f"{args.prompts} prompts x {args.prompt_len} tokens, best of {args.reps}"
    )
    print(f"  {'request':<{width}}  {'seconds':>8}  {'prompt tok/s':>12}  {'vs prefill':>10}")
    for label, secs in rows:
        print(f"  {label:<{width}}  {secs:8.3f}  {tokens / secs:12.0f}  {secs / base:9.2f}x")


if __name__ == "__main__":
    main()
