"""Speculative decoding against plain decoding: output tok/s side by side in one run.

Workloads (greedy, the same requests for every method; each method's tokens are checked
against plain decoding's, so a row is only a speed-up if it says `same`):
- copy: edit / extract / repeat requests whose answers reuse their prompt (chat template),
  built from passages of text this machine has (the standard library's docstrings);
- random: random token prompts, sampled at temperature 1 with a seed per request, `ignore_eos`
  (greedy decoding of random prompts soon loops, which n-grams predict perfectly; sampled,
  there is little to look up, and the adaptive back-off must keep speculation from costing
  more than it saves). Sampled tokens differ between methods (the same distribution, other
  draws), so these rows say `sampled` instead of `same`.

Methods: `off`, `ngram` (prompt lookup) and `draft:N` (the target's first N layers as the
draft model, early exit). Batch sizes: `--batch-sizes 1,16` (batch 1: four different
requests, one after another).

    .venv/bin/python benchmarks/spec_decode.py [--device cpu|cuda] [--model PATH|llama-3.1-8b]
        [--methods off,ngram,draft:8] [--batch-sizes 1,16] [--max-tokens 128]

`--model llama-3.1-8b` is the dummy-weight 8B shape with SmolLM2's tokenizer (as
benchmarks/serving.py --gpu; `--tokenizer DIR` where the embedded model is not installed):
its drafts are rarely accepted (random weights), so it shows the cost of verification and
the back-off, not the gain.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmesh import LLM, SamplingParams  # noqa: E402

TASKS = (
    "Here is a text:\n\n{p}\n\nWhat is the first sentence of the text? Quote it.",
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Here is a passage:\n\n{p}\n\nQuote its first three sentences exactly.",
    "Rewrite the following text with every sentence on its own line, changing nothing else:\n\n{p}",
)
BATCH1_REQUESTS = 4  # batch 1 runs this many different requests one after another


def first_difference(tokens: list[list[int]], reference: list[list[int]]) -> int:
    """-1 if every request's tokens equal the reference's, else the earliest differing position.

    In bf16 (CUDA) a verification sums in another order than a decode step, so a near tie of
    the top two logits may flip and the continuations part (benchmarks/gpu.py's tie rule); in
    fp32 on the CPU the tokens are equal. Exactness is what the tests check (fp32).
    """
    first = -1
    for t, r in zip(tokens, reference, strict=True):
        diff = next((i for i, (a, b) in enumerate(zip(t, r, strict=False)) if a != b), None)
        if diff is None and len(t) != len(r):
            diff = min(len(t), len(r))
        if diff is not None:
            first = diff if first < 0 else min(first, diff)
    return first


def verdict(first: int | None) -> str:
    if first is None:
        return "sampled"
    return "same" if first < 0 else f"differs from token {first}"


def passages(n: int) -> list[str]:
    """n passages of English prose from docstrings of the standard library (no download)."""
    import argparse as a
    import collections
    import contextlib
    import csv
    import difflib
    import functools
    import heapq
    import json as j
    import logging
    import pathlib
    import shutil
    import subprocess
    import textwrap
    import threading
    import unittest
    import zipfile

    texts = []
    for mod in (a, collections, contextlib, csv, difflib, functools, heapq, j, logging, pathlib, shutil,
                subprocess, textwrap, threading, unittest, zipfile):  # fmt: skip
        doc = " ".join((mod.__doc__ or "").split())
        if len(doc) > 300:
            texts.append(doc[:700])
    return [texts[i % len(texts)] for i in range(n)]


def copy_requests(n: int) -> list[list[dict[str, str]]]:
    texts = passages(n)
    return [[{"role": "user", "content": TASKS[i % len(TASKS)].format(p=p)}] for i, p in enumerate(texts)]


def random_prompts(n: int, vocab: int, length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(length)]} for _ in range(n)]


def spec_config(method: str, k: int) -> dict | None:
    if method == "off":
        return None
    if method in ("ngram", "ngram-nochain"):
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 5}
    if method.startswith("draft:"):
        return {"method": "draft_model", "num_speculative_tokens": k, "num_layers": int(method[6:])}
    raise SystemExit(f"unknown method {method!r}: off, ngram, ngram-nochain or draft:N")


def run(llm: LLM, requests, chat: bool, params: SamplingParams, repeats: int = 1, one_by_one: bool = False):
    """(best seconds of `repeats` runs, the tokens of the last); one_by_one: batch 1, in turn."""
    generate = llm.chat if chat else llm.generate
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        if one_by_one:
            outs = [o for r in requests for o in generate([r], params, use_tqdm=False)]
        else:
            outs = generate(requests, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    return best, [o.outputs[0].token_ids for o in outs]


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.mesh.workers["local"].planner.spec.stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def model_kwargs(args: argparse.Namespace, root: str) -> dict:
    kw: dict = {"device": args.device, "max_num_seqs": max(args.batch_sizes), "seed": 0}
    if args.model == "llama-3.1-8b":
        from benchmarks.serving import GPU_ENGINE, gpu_model

        kw |= {k: v for k, v in GPU_ENGINE.items() if k not in ("max_num_seqs", "device")}
        kw["model"] = gpu_model(root, args.tokenizer)
    else:
        kw["model"] = args.model
        if args.device == "cuda":
            kw |= {"dtype": "bfloat16", "max_model_len": 4096}
        else:
            kw["kv_cache_memory"] = 512 << 20
    return kw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None, help=".gguf or folder (default: SmolLM2) or llama-3.1-8b")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for the 8B shape (serving.py)")
    ap.add_argument("--methods", default="off,ngram")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="speculative_config's (default: its own)"
    )
    ap.add_argument("--batch-sizes", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--random-prompt-len", type=int, default=256)
    ap.add_argument("--workloads", default="copy,random")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row (the best counts)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--smoke", action="store_true", help="batch 2, 8 tokens, one repeat (make test)")
    args = ap.parse_args()
    if args.smoke:
        args.batch_sizes, args.max_tokens, args.random_prompt_len, args.repeats = [2], 8, 16, 1
    methods = args.methods.split(",")
    if methods[0] != "off":
        methods.insert(0, "off")  # the reference every other method is compared with
    workloads = args.workloads.split(",")

    rows = []
    reference: dict[tuple[str, int], tuple[float, list[list[int]]]] = {}
    with tempfile.TemporaryDirectory() as root:
        base = model_kwargs(args, root)
        for method in methods:
            spec = spec_config(method, args.num_speculative_tokens)
            if spec is not None and args.disable_by_batch_size is not None:
                spec["disable_by_batch_size"] = args.disable_by_batch_size
            chain = method != "ngram-nochain"  # the planner's A/B switch
            llm = LLM(**base, speculative_config=spec, chain_verifications=chain)
            vocab = llm.engine.runner.model_config.vocab_size
            for workload in workloads:
                chat = workload == "copy"
                if chat:  # ignore_eos: every method produces the same number of tokens
                    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
                else:
                    params = SamplingParams(temperature=1.0, seed=7, max_tokens=args.max_tokens)
                    params.ignore_eos = True
                for batch in args.batch_sizes:
                    n = BATCH1_REQUESTS if batch == 1 else batch
                    if chat:
                        reqs = copy_requests(n)
                    else:
                        reqs = random_prompts(n, vocab, args.random_prompt_len, 1)
                    # Warm up: Triton compiles this batch's kernel variants.
                    run(llm, reqs, chat, params, one_by_one=batch == 1)
                    before = spec_counts(llm)
                    seconds, tokens = run(llm, reqs, chat, params, args.repeats, one_by_one=batch == 1)
                    drafts, drafted, accepted = (a - b for a, b in zip(spec_counts(llm), before, strict=True))
                    out_tokens = sum(len(t) for t in tokens)
                    key = (workload, batch)
                    if method == "off":
                        reference[key] = (seconds, tokens)
                    base_s, base_tokens = reference[key]
                    rows.append(
                        {
                            "workload": workload,
                            "batch": batch,
                            "method": method,
                            "out_tok_s": out_tokens / seconds,
                            "speedup": base_s / seconds,
                            "same": first_difference(tokens, base_tokens) if chat else None,
                            "acceptance": accepted / drafted if drafted else 0.0,
                            "mean_accepted_len": 1 + accepted / drafts if drafts else 0.0,
                            "verifications": drafts,
                        }
                    )
                    r = rows[-1]
                    print(
                        f"{workload:>6} b{batch:<3} {method:>8}: {r['out_tok_s']:8.1f} tok/s  "
                        f"x{r['speedup']:.2f}  "
                        f"accept {r['acceptance']:.2f}  len {r['mean_accepted_len']:.2f}  "
                        f"{verdict(r['same'])}",
                        flush=True,
                    )
            llm.engine.close()  # its GPU memory is freed for the next method's engine
            del llm
            gc.collect()
            if args.device == "cuda":
                import torch

                torch.cuda.empty_cache()

    print()
    print("| workload | batch | method | out tok/s | vs off | acceptance | mean accepted length | greedy |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(
            f"| {r['workload']} | {r['batch']} | {r['method']} | {r['out_tok_s']:,.1f} | "
            f"{r['speedup']:.2f}x | "
            f"{r['acceptance']:.2f} | {r['mean_accepted_len']:.2f} | {verdict(r['same'])} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
