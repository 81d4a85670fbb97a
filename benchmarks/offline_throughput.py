"""Offline throughput: llmesh's engine against transformers.generate, side by side, one process.

One seeded random workload (prompt 32-512 tokens, output 16-128, ignore_eos).
transformers runs static batches of the same requests in order (left padding,
each batch generating until its longest request's max_tokens); both are credited
with exactly the requested output tokens.

    .venv/bin/python benchmarks/offline_throughput.py [--num-requests 64] [--hf-batch-size 16 64]
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def make_workload(n: int, vocab: int, seed: int, prompt=(32, 512), output=(16, 128)):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen, olen = rng.randint(*prompt), rng.randint(*output)
        reqs.append(([rng.randrange(100, vocab - 1) for _ in range(plen)], olen))
    return reqs


def make_sharegpt_workload(
    n: int, vocab: int, seed: int, mean_prompt: float = 220, mean_output: float = 200, clip: int = 1024
):
    """ShareGPT-shaped requests: lognormal prompt and output lengths (sigma 1) with the given
    means, clipped to [4, clip] (the shape of vLLM's and SGLang's ShareGPT offline runs)."""
    import math

    rng = random.Random(seed)
    sigma = 1.0

    def length(mean: float) -> int:
        mu = math.log(mean) - sigma**2 / 2  # so that the lognormal's mean is `mean`
        return max(4, min(clip, round(rng.lognormvariate(mu, sigma))))

    return [
        ([rng.randrange(100, vocab - 1) for _ in range(length(mean_prompt))], length(mean_output))
        for _ in range(n)
    ]


def bench_llmesh(model_path: str, reqs, dtype: str, device: str, **engine_kw) -> tuple[float, int]:
    from llmesh import LLM, SamplingParams

    llm = LLM(model=model_path, dtype=dtype, device=device, **engine_kw)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def hf_static_batch(model, batch: list[tuple[list[int], int]], pad: int, device: str) -> None:
    """One static batch through transformers.generate: left padding, every row generating the
    batch's longest max_tokens (as a static-batch server must)."""
    width = max(len(p) for p, _ in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (p, _) in enumerate(batch):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    new = max(o for _, o in batch)
    with torch.inference_mode():
        model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
        )


def bench_transformers(model_path: str, reqs, batch_size: int, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa").to(
        device
    )
    model.eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0

    hf_static_batch(model, reqs[:2], pad, device)  # warm-up
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        hf_static_batch(model, reqs[i : i + batch_size], pad, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, sum(o for _, o in reqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, nargs="+", default=[16, 64], help="one run per batch size")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="4 short requests, llmesh only (make test)")
    args = ap.parse_args()
    prompt_len, output_len = (32, 512), (16, 128)  # make_workload's defaults
    if args.smoke:
        args.num_requests, prompt_len, output_len = 4, (8, 16), (4, 8)
        if not args.skip_transformers:  # importing transformers and its generate: ~35 s of a 2-core CPU
            print("smoke: the transformers baseline is skipped")
            args.skip_transformers = True

    from services.model_files import resolve_model
    from worker_svc.models.config import ModelConfig

    path = resolve_model(args.model)
    vocab = ModelConfig.from_pretrained(path).vocab_size
    reqs = make_workload(args.num_requests, vocab, args.seed, prompt_len, output_len)
    print(
        f"workload: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
        f"{sum(o for _, o in reqs)} output tokens; torch threads={torch.get_num_threads()}"
    )
    rows = []
    dt, toks = bench_llmesh(
        path,
        reqs,
        args.dtype,
        args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    rows.append(("llmesh", dt, toks))
    if not args.skip_transformers:
        tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
        for batch_size in args.hf_batch_size:
            dt, toks = bench_transformers(path, reqs, batch_size, tdtype, args.device)
            rows.append((f"transformers (batch {batch_size})", dt, toks))
    ours = rows[0][1]
    print(f"\n{'engine':<28}{'time s':>9}{'req/s':>9}{'out tok/s':>11}{'llmesh is':>11}")
    for name, dt, toks in rows:
        print(f"{name:<28}{dt:>9.2f}{len(reqs) / dt:>9.2f}{toks / dt:>11.1f}{dt / ours:>10.2f}x")


if __name__ == "__main__":
    main()
