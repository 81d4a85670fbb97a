"""FP8 quality on real weights: perplexity against the unquantized model, greedy agreement, bytes.

    .venv/bin/python benchmarks/fp8_quality.py [--model DIR] [--tokens 1000] [--recipes fp8,edge-down]
    .venv/bin/python benchmarks/fp8_quality.py --smoke     # a tiny random model, a few tokens

Each recipe is an FP8 checkpoint written by `llmesh quantize`'s writer (worker_svc/models/
fp8_writer.py, with the recipe's modules kept in their dtype) and loaded back through the offline
engine, so the figures are the checkpoint's as served. The reference is the same checkpoint
unquantized, in fp32 on the CPU (the tests' greedy reference). Perplexity: the engine's prompt
logprobs over the first --tokens tokens of each text (three kinds of text: prose, a README,
Python source); greedy agreement: the tokens of --new-tokens greedy continuations of a few
prompts that equal the reference's, up to the first that differs. Weight bytes: the decoder's
linear layers as served on a GPU (FP8 codes and scales, kept layers in bf16) against all bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from worker_svc.models.fp8_writer import edge_down_proj, edge_layers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = {"prose": "docs/architecture.md", "README": "README.md", "Python": "worker_svc/runner.py"}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three most important things about a key-value cache are",
]


# recipe -> the modules it keeps in the model's dtype, given the number of decoder layers
RECIPES: dict[str, Callable[[int], list[str]]] = {
    "fp8": lambda layers: [],
    "edge-down": edge_down_proj,  # `llmesh quantize --recipe edge-down`
    "edge-layers": edge_layers,  # `--recipe edge-layers`
    "all-down": lambda layers: ["re:.*mlp\\.down_proj"],
}


def _llm(path: str, dtype: str) -> Any:
    from llmesh import LLM

    return LLM(path, dtype=dtype, device="cpu", max_model_len=2048, num_kv_blocks=256, enforce_eager=True)


def _token_nlls(llm: Any, ids: list[int]) -> list[float]:
    """Each next token's NLL over `ids` (the engine's prompt logprobs)."""
    from llmesh import SamplingParams

    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)
    lps = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].prompt_logprobs
    return [-lps[i][tok].logprob for i, tok in enumerate(ids) if i]


def _greedy(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from llmesh import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _agree(a: list[list[int]], b: list[list[int]]) -> int:
    """Tokens equal to the reference's, up to the first that differs, summed over prompts."""
    total = 0
    for x, y in zip(a, b, strict=True):
        for p, q in zip(x, y, strict=True):
            if p != q:
                break
            total += 1
    return total


def _linear_bytes(shapes: dict[str, tuple[int, ...]], kept: Callable[[str], bool]) -> tuple[int, int]:
    """(bytes as served: FP8 codes + fp32 scales, kept layers in bf16; bytes all in bf16) of the
    decoder's linear weights."""
    from worker_svc.models.fp8_writer import is_linear_weight

    served = bf16 = 0
    for name, shape in shapes.items():
        if not is_linear_weight(name):
            continue
        n = math.prod(shape)
        bf16 += 2 * n
        served += 2 * n if kept(name.removesuffix(".weight")) else n + 4 * shape[0]
    return served, bf16


def _smoke_model(root: str) -> str:
    """A tiny random Llama checkpoint (fp32 safetensors) made in memory."""
    from safetensors.torch import save_file

    from benchmarks.gpu import SMOKE_SHAPES, write_config
    from worker_svc.loader import load_model
    from worker_svc.models.fp8_writer import hf_named_tensors

    cfg = write_config(root, "tiny", SMOKE_SHAPES["llama-tiny"])
    model, _ = load_model(cfg, load_format="dummy")
    save_file({n: t.contiguous() for n, t in hf_named_tensors(model)}, os.path.join(cfg, "model.safetensors"))
    return cfg


def _texts(args: argparse.Namespace, folder: str) -> tuple[dict[str, list[int]], list[list[int]]]:
    """Token ids of the texts and of the prompts (bytes as ids for the tokenizer-less smoke model)."""
    files = {os.path.basename(p): p for p in args.texts.split(",")} if args.texts else TEXTS
    raw = {name: open(os.path.join(ROOT, path), encoding="utf-8").read() for name, path in files.items()}
    if args.smoke:
        enc: Callable[[str], list[int]] = lambda s: [b % 1000 + 3 for b in s.encode()]  # noqa: E731
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        enc = lambda s: tok(s)["input_ids"]  # noqa: E731
    texts = {name: enc(text)[: args.tokens] for name, text in raw.items()}
    return texts, [enc(p) for p in PROMPTS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="bf16/fp32 HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--tokens", type=int, default=1000, help="tokens of each text scored")
    ap.add_argument(
        "--texts", default=None, help="comma-separated files to score instead of the three default ones"
    )
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt")
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {', '.join(RECIPES)}")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the dtype every engine runs in, the reference's too (bfloat16: FP8 against bf16, as served)",
    )
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, 32 tokens, one recipe")
    args = ap.parse_args()
    recipes = args.recipes.split(",")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        sys.exit(f"--recipes: unknown {unknown}; known: {', '.join(RECIPES)}")
    if args.smoke:
        args.tokens, args.new_tokens, recipes = 32, 4, ["edge-down"]

    from services.model_files import resolve_model
    from worker_svc.loader import safetensors_files
    from worker_svc.models.fp8_checkpoint import header_shapes, parse_scheme
    from worker_svc.models.fp8_writer import quantization_config, quantize_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        src = _smoke_model(tmp) if args.smoke else resolve_model(args.model)
        with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
            layers = json.load(f)["num_hidden_layers"]
        shapes = header_shapes(safetensors_files(src))
        texts, prompts = _texts(args, src)
        ref = _llm(src, args.dtype)
        base = {name: _token_nlls(ref, ids) for name, ids in texts.items()}
        ref_greedy = _greedy(ref, prompts, args.new_tokens)
        ref.close()
        rows = []
        for recipe in recipes:
            kept = RECIPES[recipe](layers)
            out = os.path.join(tmp, recipe)
            quantize_checkpoint(src, out, ignore=kept, progress=False)
            llm = _llm(out, args.dtype)
            nlls = {name: _token_nlls(llm, ids) for name, ids in texts.items()}
            ppl = {name: math.exp(_mean(nlls[name]) - _mean(base[name])) - 1 for name in texts}
            moved = _mean([abs(a - b) for name in texts for a, b in zip(nlls[name], base[name], strict=True)])
            agree = _agree(_greedy(llm, prompts, args.new_tokens), ref_greedy)
            llm.close()
            served, bf16 = _linear_bytes(
                shapes, parse_scheme(quantization_config("compressed-tensors", kept)).ignores
            )
            rows.append((recipe, ppl, moved, agree, served / bf16))
    _print_table(texts, base, rows, len(prompts) * args.new_tokens, args.dtype)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _print_table(
    texts: dict[str, list[int]],
    base: dict[str, list[float]],
    rows: list[tuple[str, dict[str, float], float, int, float]],
    n: int,
    dtype: str,
) -> None:
    """Perplexity change per text; |dNLL|: each scored token's NLL change, its absolute value
    averaged over every text (less noisy than perplexity, whose changes partly cancel)."""
    names = list(texts)
    head = " | ".join(f"{k} ({len(texts[k])} tok)" for k in names)
    print(f"\n| recipe | {head} | mean abs dNLL | greedy | linear bytes |")
    print("| --- |" + " ---: |" * (len(names) + 3))
    cells = " | ".join(f"ppl {math.exp(_mean(base[k])):.3f}" for k in names)
    ref = "fp32" if dtype == "float32" else "bf16"
    print(f"| unquantized ({ref}) | {cells} | | | 1.00 |")
    for recipe, ppl, moved, agree, ratio in rows:
        cells = " | ".join(f"{100 * ppl[k]:+.2f} %" for k in names)
        print(f"| {recipe} | {cells} | {moved:.4f} | {agree}/{n} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
