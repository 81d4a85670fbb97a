"""Multi-LoRA throughput: a batch of 64 over 8 adapters against the base model alone, one engine.

One engine with LoRA on (--max-loras 8, rank 16), random weights of the Llama-3.1-8B shape
(`--load-format dummy`, bf16, CUDA graphs), --num-adapters random PEFT adapters of rank --rank on
all seven projections (written to a temporary folder, loaded by the worker on first use, in the
warm-up), and one seeded workload of --batch requests (prompt and output lengths in ranges,
ignore_eos, greedy) submitted at once, so that decodes run at the full batch. Rows:

* base: every request on the base model (the base decode graphs, which hold no LoRA work);
* N adapters: request i on adapter i % N (the LoRA decode graphs: one batched shrink and expand
  per projection over every adapter's rows);
* 1 adapter: every request on adapter 0.

Output tokens/s (best of --repeats) and the ratio to the base row. Issue 34's must-show: 8
adapters at batch 64 >= 80 % of the base model alone, on the H100.

    .venv/bin/python benchmarks/lora.py                  # Llama-3.1-8B shape on cuda
    .venv/bin/python benchmarks/lora.py --smoke          # tiny shapes on the CPU (make test)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gpu import SHAPES, SMOKE_SHAPES, write_config  # noqa: E402
from llmesh import LLM, LoRARequest, SamplingParams  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of a Llama-shaped config."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {
        "q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
        "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
    }  # fmt: skip


def write_adapter(path: str, cfg: dict, rank: int, seed: int) -> str:
    """A random PEFT adapter (bf16 safetensors) of `rank` on every projection of every layer."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (out_f, in_f) in projection_shapes(cfg).items():
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            a = torch.randn(rank, in_f, generator=gen) * in_f**-0.5
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_f, rank, generator=gen) * 0.01).to(
                torch.bfloat16
            )
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({**config, "bias": "none", "task_type": "CAUSAL_LM"}, f)
    return path


def workload(
    n: int, vocab: int, seed: int, prompt: list[int], output: list[int]
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab - 1) for _ in range(rng.randint(*prompt))], rng.randint(*output))
        for _ in range(n)
    ]


def run(llm: LLM, reqs, loras: list[LoRARequest | None]) -> tuple[float, int]:
    """(seconds, output tokens) of one generate over the workload."""
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[128, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[256, 256])
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per row (the best counts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (every step eager)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, batch 4, 2 adapters")
    args = ap.parse_args()
    cfg = SHAPES[args.model]
    if args.smoke:
        cfg, args.model = SMOKE_SHAPES["llama-tiny"], "llama-tiny"
        args.device, args.batch, args.num_adapters, args.rank, args.repeats = "cpu", 4, 2, 8, 1
        args.prompt_len, args.output_len = [8, 16], [4, 4]
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --smoke for a dry run on the CPU)")
    max_len = args.prompt_len[1] + args.output_len[1] + 16
    with tempfile.TemporaryDirectory() as root:
        path = write_config(root, "model", cfg)
        adapters = [
            LoRARequest(f"lora{i}", i + 1, write_adapter(os.path.join(root, f"lora{i}"), cfg, args.rank, i))
            for i in range(args.num_adapters)
        ]
        llm = LLM(
            path, load_format="dummy", device=args.device,
            dtype="bfloat16" if args.device == "cuda" else "float32",
            enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank,
            max_num_seqs=args.batch, max_model_len=max_len, enforce_eager=args.enforce_eager,
            enable_prefix_caching=False,  # every run computes its prompts: rows and repeats alike
        )  # fmt: skip
        reqs = workload(args.batch, cfg["vocab_size"], args.seed, args.prompt_len, args.output_len)
        rows = {
            "base": [None] * len(reqs),
            f"{args.num_adapters} adapters": [adapters[i % len(adapters)] for i in range(len(reqs))],
            "1 adapter": [adapters[0]] * len(reqs),
        }
        warm = reqs[: len(adapters)]
        run(llm, [(p, 4) for p, _ in warm], adapters[: len(warm)])  # loads every adapter, compiles
        results = {}
        for name, loras in rows.items():
            best = min((run(llm, reqs, loras) for _ in range(args.repeats)), key=lambda r: r[0])
            results[name] = best[1] / best[0]
    base = results["base"]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\nLoRA throughput: {args.model} on {device}, batch {args.batch}, rank {args.rank}, "
          f"prompts {args.prompt_len}, outputs {args.output_len}")  # fmt: skip
    print(f"| {'row':<12} | {'output tok/s':>12} | {'vs base':>7} |")
    print(f"| {'-' * 12} | {'-' * 12} | {'-' * 7} |")
    for name, tps in results.items():
        print(f"| {name:<12} | {tps:>12.1f} | {tps / base:>7.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
