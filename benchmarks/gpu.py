"""The GPU benchmark: checks and times llmesh on one CUDA device, printing one table.

    .venv/bin/python benchmarks/gpu.py [--models llama-3.1-8b,qwen2.5-0.5b] [--out DIR]
    .venv/bin/python benchmarks/gpu.py --tensor-parallel-size 2 --models llama-3.1-8b,llama-3.1-70b \
        --sections ceilings,models --skip-transformers          # two GPUs, one engine over both

With --tensor-parallel-size N every engine splits its model over N GPUs (rank processes, NCCL).
The batch-1 floor is then per GPU (rank 0's shard bytes / copy bandwidth; target <= 1.3x), and
the shapes in --tp-compare-models (8B) also run on one GPU: greedy TP vs size 1 under the tie
rule below, and the batch-1 step of TP / size 1 (target <= 0.6x). The 70B shape (80 layers,
8192 hidden, GQA 64/8) fits only at N >= 2.

Every model is random-weight (`--load-format dummy`: weights of the right shapes made on the
device), so no weight files are needed. Sections, in order:

1. ceilings: device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate;
1b. longctx (benchmarks/long_context.py, only when named): batch-1 decode at --long-context
   tokens per weights:KV-cache dtype pair of --long-configs, against its floor (weight + KV
   bytes a step reads / copy bandwidth), and the KV blocks each cache dtype gets;
2. decode attention (Triton paged kernel, Llama-3.1-8B heads: 32 query / 8 KV, D=128, block
   16): bytes of K/V read / time at batch x context, as a fraction of the copy bandwidth. Each
   cell is timed as a CUDA graph over several K/V sets (>= 256 MiB together), so that small
   cells measure HBM, not L2 or launch latency; cells with batch >= 16 under 80% are also timed
   with forced split-K counts (diagnostic rows);
3. per model shape:
   * (Llama-3.1-8B) one decode step at batch 1, end to end through the engine (planner, CUDA
     graph, lm_head, sampler, the one host sync), the graph alone, and the step's GPU work
     back to back (graph + lm_head + argmax), against the floor: bytes of weights a decode step
     reads (all but the embedding table) / copy bandwidth;
   * offline throughput of llmesh on a seeded workload (prompt 128-1024, output 128-512,
     ignore_eos) against transformers.generate (bf16, sdpa, static batches, left padding,
     each batch generating up to its longest request). transformers is timed on the first
     --hf-requests requests of the same workload and its time scaled to the whole workload
     (static batches are independent, so that is an estimate of the whole run);
   * correctness: greedy output of the Triton backend (CUDA graphs) against the reference
     torch backend (eager), same random weights, first 64 tokens of several prompts.

Correctness rule (bf16): a prompt passes if both backends emit the same 64 tokens, or if they
first differ at a position where the reference's two candidates are a near tie (their
reference logprobs within --tie-tol nats); after a near tie the continuations legitimately
differ. The logits leave the bf16 lm_head rounded to bf16, so logprob gaps come in whole bf16
ulps of the logit (1/32 for |logit| in [4, 8), 1/16 in [8, 16)): the default tolerance, 0.125
nats, is 2 ulps in [8, 16), about one bf16 rounding of the final hidden state. The largest
|logprob difference| of the greedy token over agreeing positions is shown.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LLAMA_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
QWEN_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "max_window_layers": 21,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "torch_dtype": "bfloat16",
}
# Llama-3.1-70B's shape (dummy weights): 141 GB of bf16 weights, for --tensor-parallel-size >= 2.
LLAMA_70B: dict[str, Any] = {
    **LLAMA_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}
SHAPES = {"llama-3.1-8b": LLAMA_8B, "qwen2.5-0.5b": QWEN_05B, "llama-3.1-70b": LLAMA_70B}
# Tiny shapes for --smoke (a quick run of every code path, also on CPU).
SMOKE_SHAPES = {
    "llama-tiny": {
        **LLAMA_8B,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1024,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen-tiny": {
        **QWEN_05B,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}

ROWS: list[tuple[str, str, str, str]] = []  # (section, item, value, target / note)


def log(*args: Any) -> None:
    print(*args, flush=True)


def row(section: str, item: str, value: str, note: str = "") -> None:
    ROWS.append((section, item, value, note))
    log(f"  [{section}] {item}: {value} {note}")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_greedy(llm, prompt: dict, tokens: int) -> float:
    """Wall seconds for one greedy generation of exactly `tokens` tokens of `prompt` (synced)."""
    from llmesh import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([prompt], sp, use_tqdm=False)
    sync()
    return time.perf_counter() - t0


def gpu_time(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median seconds of fn() over reps, timed with CUDA events (host clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------
# 1. ceilings


def copy_ceiling(args: argparse.Namespace) -> float:
    """The device's copy bandwidth (bytes read + written per second): every floor divides by it."""
    n = (args.copy_mib << 20) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=args.device)
    dst = torch.empty_like(src)
    t = gpu_time(lambda dst=dst, src=src: dst.copy_(src), reps=20)
    copy_bw = 2 * src.numel() * 2 / t
    row("ceilings", f"D2D copy, {args.copy_mib} MiB (read + write)", f"{copy_bw / 1e12:.3f} TB/s")
    del src, dst
    free_cuda()
    return copy_bw


def matmul_ceiling(args: argparse.Namespace) -> float:
    dev = args.device
    m = args.matmul_n
    a = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    t = gpu_time(lambda a=a, b=b: a @ b, reps=20)
    tflops = 2 * m**3 / t / 1e12
    row("ceilings", f"bf16 matmul {m}^3 (random data)", f"{tflops:.0f} TFLOP/s")
    del a, b
    free_cuda()
    return tflops


def fp8_matmul_ceiling(args: argparse.Namespace) -> float:
    """TFLOP/s of an e4m3 `torch._scaled_mm` at --matmul-n cubed, bf16 out (the FP8 GEMMs' peak)."""
    dev, m = args.device, args.matmul_n
    a = torch.randn(m, m, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device=dev).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
    one = torch.ones((), device=dev)
    t = gpu_time(
        lambda a=a, b=b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), reps=20
    )
    tflops = 2 * m**3 / t / 1e12
    row("ceilings", f"fp8 matmul {m}^3 (random data)", f"{tflops:.0f} TFLOP/s")
    del a, b
    free_cuda()
    return tflops


# ------------------------------------------------------------------------------------------
# 2. decode attention


def attention_sweep(args: argparse.Namespace, copy_bw: float) -> None:
    import kernels.triton as kt
    from kernels import reference
    from kernels.attention_metadata import AttentionMetadata

    dev = args.device
    heads, kv_heads, d, bs = 32, 8, 128, 16
    if args.smoke:
        heads, kv_heads, d = 8, 2, 64
    token_bytes = kv_heads * d * 2 * 2  # K and V, bf16
    batches = [int(x) for x in args.attn_batches.split(",")]
    contexts = [int(x) for x in args.attn_contexts.split(",")]
    rot_bytes = args.attn_rotate_mib << 20
    max_tokens = max(max(b * c, min(rot_bytes // token_bytes, 64 * b * c)) for b in batches for c in contexts)
    num_blocks = max_tokens // bs + 1
    cache = torch.empty((2, num_blocks, bs, kv_heads, d), dtype=torch.bfloat16, device=dev)
    cache.normal_()
    log(f"decode attention: K/V cache {cache.numel() * 2 / 2**30:.1f} GiB, {num_blocks} blocks")
    gen = torch.Generator(device="cpu").manual_seed(0)
    scale = d**-0.5
    table: dict[tuple[int, int], float] = {}
    # Checked against the fp32 twin after the whole grid is timed: a check between cells slowed
    # the next cell's timing by ~10% (seen on an H100: 79% there, 92% when re-timed).
    check_cells = {(min(batches), contexts[0]), (32, 2048)}
    checks: list[tuple[int, int, Any]] = []
    for b in batches:
        for ctx in contexts:
            kv_bytes = b * ctx * token_bytes
            n_rot = max(1, min(64, math.ceil(rot_bytes / kv_bytes)))
            nb = ctx // bs
            perm = torch.randperm(num_blocks, generator=gen)[: n_rot * b * nb].to(torch.int32)
            calls = []
            for r in range(n_rot):
                bt = perm[r * b * nb : (r + 1) * b * nb].view(b, nb).to(dev)
                meta = AttentionMetadata(
                    slot_mapping=torch.zeros(b, dtype=torch.long, device=dev),
                    query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev),
                    seq_lens=torch.full((b,), ctx, dtype=torch.int32, device=dev),
                    block_tables=bt,
                    max_query_len=1,
                    max_seq_len=ctx,
                    query_lens_cpu=[1] * b,
                    seq_lens_cpu=[ctx] * b,
                )
                q = torch.randn(b, heads, d, dtype=torch.bfloat16, device=dev)
                calls.append((q, meta, torch.empty_like(q)))

            def run_all(calls=calls, cache=cache) -> None:
                for q, meta, out in calls:
                    kt.paged_attention(q, cache, meta, scale, out=out)

            run_all()  # compile
            if torch.cuda.is_available():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run_all()
                t = gpu_time(graph.replay, reps=args.attn_reps) / n_rot
            else:
                t = gpu_time(run_all, reps=2, warmup=0) / n_rot
            table[(b, ctx)] = kv_bytes / t
            if (b, ctx) in check_cells:
                checks.append((b, ctx, calls[0]))
            if (
                args.attn_splits_diag
                and b >= 16
                and kv_bytes / t / copy_bw < 0.8
                and torch.cuda.is_available()
            ):
                alt = {}
                for ns in args.attn_splits_diag:

                    def run_ns(calls=calls, cache=cache, ns=ns) -> None:
                        for q, meta, out in calls:
                            kt.paged_attention(q, cache, meta, scale, out=out, num_splits=ns)

                    run_ns()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        run_ns()
                    alt[ns] = kv_bytes / (gpu_time(g.replay, reps=args.attn_reps) / n_rot) / copy_bw
                row(
                    "attention diag",
                    f"B={b} ctx={ctx}: forced num_splits",
                    f"default {kv_bytes / t / copy_bw:.0%}",
                    ", ".join(f"{k}: {v:.0%}" for k, v in alt.items()),
                )
    for b, ctx, (q, meta, out) in checks:
        # `out` holds what the timed graph replays wrote.
        ref = reference.paged_attention(q.float(), cache, meta, scale)  # gathers, then fp32
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ok = err < 1e-2 and not out.isnan().any().item()
        row(
            "attention check",
            f"B={b} ctx={ctx} vs fp32 twin",
            f"rel err {err:.1e}",
            "OK (< 1e-2, bf16)" if ok else "FAILED",
        )
    del cache
    free_cuda()
    # One row per cell plus a grid for the docs.
    head = "batch \\ ctx " + "".join(f"{c:>14}" for c in contexts)
    lines = [head]
    for b in batches:
        cells = "".join(f"{table[(b, c)] / 1e12:>6.2f} ({table[(b, c)] / copy_bw:>4.0%})" for c in contexts)
        lines.append(f"{b:>11} " + cells)
    log("decode attention, TB/s of K/V read (fraction of copy bandwidth):\n" + "\n".join(lines))
    target = [table[(b, c)] / copy_bw for b in batches for c in contexts if b >= 32 and c >= 2048]
    if target:
        row(
            "decode attention",
            "min fraction of copy BW at batch >= 32, ctx >= 2k",
            f"{min(target):.0%}",
            f"target >= 75%: {'met' if min(target) >= 0.75 else 'MISSED'}",
        )
    best = max(table.values())
    row("decode attention", "best cell", f"{best / 1e12:.2f} TB/s ({best / copy_bw:.0%})")
    ATTN_GRID.extend(lines)


ATTN_GRID: list[str] = []


# ------------------------------------------------------------------------------------------
# 3. engine: decode step, throughput, correctness, transformers


def write_config(root: str, name: str, cfg: dict[str, Any]) -> str:
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The seeded workload and engine limits every GPU benchmark takes (see engine_settings)."""
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[128, 1024])
    ap.add_argument("--output-len", type=int, nargs=2, default=[128, 512])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="GPUs (ranks) each engine splits the model over"
    )
    ap.add_argument(
        "--tp-all-reduce",
        default="auto",
        choices=["auto", "nccl"],
        help="the worker's tp_all_reduce (auto: peer-to-peer one-shot for small messages)",
    )
    ap.add_argument(
        "--decode-gemm",
        default="auto",
        choices=["auto", "cublas"],
        help="the worker's decode_gemm (auto: a Triton skinny GEMM where it beats cuBLAS at start)",
    )
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="the worker's quantization (fp8: W8A8 e4m3, weights quantized on load)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="the worker's KV cache dtype (fp8: e4m3 with per-layer K and V scales)",
    )


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings every GPU benchmark runs with (random weights, bf16 on CUDA)."""
    return dict(
        load_format="dummy",
        dtype="bfloat16" if args.device == "cuda" else "float32",
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        tp_all_reduce=getattr(args, "tp_all_reduce", "auto"),
        decode_gemm=getattr(args, "decode_gemm", "auto"),
        quantization=getattr(args, "quantization", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
    )


def make_llm(path: str, args: argparse.Namespace, **kw: Any):
    from llmesh import LLM

    base = engine_settings(args)
    base.update(kw)
    try:
        return LLM(path, **base)
    except Exception:
        if base.get("enforce_eager"):
            raise
        log("!! engine with CUDA graphs failed; retrying with enforce_eager=True")
        traceback.print_exc()
        free_cuda()
        base["enforce_eager"] = True
        return LLM(path, **base)


def decode_step_b1(llm, name: str, args: argparse.Namespace, copy_bw: float, label: str = "") -> float:
    """Batch-1 decode step time (s). With tensor parallelism the model here is rank 0's shard, so
    the bytes and the floor are per GPU (every rank reads its shard at once)."""

    runner = llm.engine.runner
    model = runner.model
    tp = runner.tp.size
    name = f"{name}{label}"
    read_bytes = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n
    )
    if model.lm_head is None:  # tied: the embedding matrix is read whole as the lm_head
        read_bytes += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    floor = read_bytes / copy_bw
    prompt = {"prompt_token_ids": list(range(1000, 1000 + args.b1_prompt))}
    n = args.b1_steps

    def gen(tokens: int) -> float:
        return time_greedy(llm, prompt, tokens)

    gen(n + 1)
    t_prefill = min(gen(1) for _ in range(3))
    t_all = min(gen(n + 1) for _ in range(2))
    step = (t_all - t_prefill) / n
    row(
        name,
        "weight bytes read per decode step" + (f", per GPU (TP {tp})" if tp > 1 else ""),
        f"{read_bytes / 1e9:.2f} GB",
        "all weights but the embedding table",
    )
    row(name, "floor (bytes / copy BW)", f"{floor * 1e3:.2f} ms")
    target = 1.25 if tp == 1 else 1.3  # TP adds two all-reduces per layer
    verdict = "met" if step <= target * floor else "MISSED"
    row(
        name,
        "decode step, batch 1, end to end",
        f"{step * 1e3:.2f} ms",
        f"{step / floor:.2f}x floor; target <= {target}x: {verdict}",
    )
    graphs = runner._graphs
    if tp > 1:
        return step  # rank 0's graph replayed alone would wait forever for the other ranks
    if graphs is not None and 1 in graphs.graphs:
        t = gpu_time(graphs.graphs[1].replay, reps=20)
        row(
            name,
            "decode graph replay alone (no lm_head/sampler)",
            f"{t * 1e3:.2f} ms",
            f"{t / floor:.2f}x floor",
        )
        out = graphs.outputs[1]

        def step_kernels() -> None:
            graphs.graphs[1].replay()
            model.compute_logits(out[:1]).argmax(dim=-1)

        t2 = gpu_time(step_kernels, reps=20)
        row(
            name,
            "graph + lm_head + argmax, back to back (GPU)",
            f"{t2 * 1e3:.2f} ms",
            f"{t2 / floor:.2f}x floor; the rest of the end-to-end step is exposed host time",
        )
    elif graphs is None:
        row(name, "CUDA graphs", "off", "eager fallback")
    return step


def llmesh_throughput(llm, reqs, name: str) -> float:
    from llmesh import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    # Warm-up: compiles the prefill/mixed kernel variants (Triton specialises the sequence count
    # on == 1 and on divisibility by 16) outside the timed run.
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for k in (1, 3, 16):
        llm.generate(prompts[:k], [short] * len(prompts[:k]), use_tqdm=False)
    steps0 = llm.engine.num_steps
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    dt = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = sum(o for _, o in reqs)
    assert toks == expected, (toks, expected)
    row(
        name,
        f"llmesh: {len(reqs)} requests",
        f"{dt:.1f} s",
        f"{toks / dt:,.0f} out tok/s, {llm.engine.num_steps - steps0} steps",
    )
    return toks / dt


def greedy_outputs(llm, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[Any]]]:
    from llmesh import SamplingParams

    # 8 candidates: a random-weight model over a large vocabulary often has 3+ near-tied top
    # tokens, and a divergence to the third must be judged by its logprob, not called "not a tie".
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def compare_greedy(ref, test, tie_tol: float) -> tuple[bool, list[str], float]:
    """(passed, a note per prompt, max |logprob diff| over agreeing positions)."""
    ok, notes, max_dlp = True, [], 0.0
    for (r_ids, r_lp), (t_ids, t_lp) in zip(ref, test, strict=True):
        diverged = None
        for j, (a, b) in enumerate(zip(r_ids, t_ids, strict=True)):
            if a == b:
                max_dlp = max(max_dlp, abs(r_lp[j].logprob - t_lp[j].logprob))
                continue
            ref_top = dict(zip(r_lp[j].top_token_ids, r_lp[j].top_logprobs, strict=True))
            gap = r_lp[j].logprob - ref_top.get(b, -math.inf)
            diverged = (j, gap)
            break
        if diverged is None:
            notes.append(f"{len(r_ids)}/{len(r_ids)} equal")
        else:
            j, gap = diverged
            tie = gap <= tie_tol
            ok &= tie
            notes.append(f"differ at {j} (ref gap {gap:.3f}: {'near tie' if tie else 'NOT a tie'})")
    return ok, notes, max_dlp


def correctness(llm, path: str, name: str, args: argparse.Namespace):
    prompts = [
        list(range(100 + 7 * i, 100 + 7 * i + length)) for i, length in enumerate(args.check_prompt_lens)
    ]
    test = greedy_outputs(llm, prompts, args.check_tokens)
    return prompts, test


def correctness_ref(path: str, name: str, args: argparse.Namespace, prompts, test) -> None:
    ref_llm = make_llm(
        path, args, attention_backend="torch", enforce_eager=True, num_kv_blocks=args.check_kv_blocks
    )
    ref = greedy_outputs(ref_llm, prompts, args.check_tokens)
    del ref_llm
    free_cuda()
    ok, notes, max_dlp = compare_greedy(ref, test, args.tie_tol)
    row(
        name,
        f"greedy Triton+graphs vs reference, {len(prompts)} prompts x {args.check_tokens} tokens",
        "PASS" if ok else "FAIL",
        "; ".join(notes),
    )
    row(
        name,
        "max |logprob diff| of greedy token (agreeing positions)",
        f"{max_dlp:.3f}",
        f"near-tie tolerance {args.tie_tol} nats",
    )


def hf_throughput(
    path: str, reqs, batch_size: int, n_req: int, name: str, args: argparse.Namespace
) -> float | None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        except TypeError:
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, attn_implementation="sdpa")
    model = model.to(device=args.device, dtype=dtype).eval()
    pad = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else 0

    from benchmarks.offline_throughput import hf_static_batch

    def run_batch(batch, model=model) -> None:
        hf_static_batch(model, batch, pad, args.device)

    run_batch([(reqs[0][0][:64], 4)] * 2)  # warm-up
    n_req = min(max(n_req, batch_size), len(reqs))
    n_req -= n_req % batch_size if n_req >= batch_size else 0
    measured = reqs[:n_req]
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(measured), batch_size):
        run_batch(measured[i : i + batch_size])
    sync()
    dt = time.perf_counter() - t0
    del model
    free_cuda()
    rate = sum(o for _, o in measured) / dt
    est = sum(o for _, o in reqs) / rate
    row(
        name,
        f"transformers, static batch {batch_size}",
        f"{est:.1f} s (est.)",
        f"{rate:,.0f} out tok/s; timed {len(measured)} of {len(reqs)} requests ({dt:.1f} s), scaled",
    )
    return rate


def model_section(
    name: str, cfg: dict[str, Any], root: str, args: argparse.Namespace, copy_bw: float
) -> None:
    from benchmarks.offline_throughput import make_workload

    free_cuda()  # memory the caching allocator keeps would be missing from the KV budget
    path = write_config(root, name, cfg)
    n_req = args.num_requests if name != "llama-3.1-8b" else (args.num_requests_8b or args.num_requests)
    reqs = make_workload(
        n_req, cfg["vocab_size"], args.seed, prompt=tuple(args.prompt_len), output=tuple(args.output_len)
    )
    log(
        f"\n== {name}: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
        f"{sum(o for _, o in reqs)} output tokens"
    )
    t0 = time.perf_counter()
    llm = make_llm(path, args)
    graphs = llm.engine.runner._graphs
    row(
        name,
        "engine start (dummy weights, KV, graph capture)",
        f"{time.perf_counter() - t0:.1f} s",
        f"{llm.engine.runner.num_kv_blocks} KV blocks; graphs {graphs.sizes if graphs else 'off'}"
        + (f" captured in {graphs.capture_seconds:.1f} s" if graphs else ""),
    )
    step_tp = None
    try:
        if name in args.b1_models:
            step_tp = decode_step_b1(llm, name, args, copy_bw)
        rate = llmesh_throughput(llm, reqs, name) if not args.skip_throughput else None
        prompts, test = correctness(llm, path, name, args) if not args.skip_check else (None, None)
    finally:
        llm.engine.close()  # ends the other tensor-parallel ranks too
        del llm, graphs
        free_cuda()
    if args.tensor_parallel_size > 1 and name in args.tp_compare_models:
        tensor_parallel_vs_size_1(path, name, args, copy_bw, step_tp, prompts, test)
    elif prompts is not None:
        correctness_ref(path, name, args, prompts, test)
    if rate is not None and not args.skip_transformers:
        for bsz in args.hf_batch_sizes:
            try:
                hf = hf_throughput(path, reqs, bsz, args.hf_requests, name, args)
            except Exception as e:  # keep the rest of the table
                traceback.print_exc()
                row(name, f"transformers, static batch {bsz}", "ERROR", repr(e)[:120])
                free_cuda()
                continue
            verdict = "met" if rate / hf >= 8 else "MISSED"
            row(name, f"llmesh / transformers (batch {bsz})", f"{rate / hf:.1f}x", f"target >= 8x: {verdict}")


def tensor_parallel_vs_size_1(
    path: str, name: str, args: argparse.Namespace, copy_bw: float, step_tp, prompts, test
) -> None:
    """The same shape on one GPU: greedy equal to the TP run (bf16 tie rule), and the batch-1
    decode step of TP against size 1's (target <= 0.6x)."""
    one = make_llm(path, args, tensor_parallel_size=1)
    try:
        step_1 = decode_step_b1(one, name, args, copy_bw, label=" (size 1)") if step_tp else None
        ref = greedy_outputs(one, prompts, args.check_tokens) if prompts is not None else None
    finally:
        one.engine.close()
        del one
        free_cuda()
    tp = args.tensor_parallel_size
    if ref is not None:
        ok, notes, max_dlp = compare_greedy(ref, test, args.tie_tol)
        row(
            name,
            f"greedy TP {tp} vs size 1, {len(prompts)} prompts x {args.check_tokens} tokens",
            "PASS" if ok else "FAIL",
            "; ".join(notes) + f"; max |logprob diff| {max_dlp:.3f}",
        )
    if step_tp and step_1:
        ratio = step_tp / step_1
        verdict = "met" if ratio <= 0.6 else "MISSED"
        row(name, f"batch-1 decode step, TP {tp} / size 1", f"{ratio:.2f}x", f"target <= 0.6x: {verdict}")


def print_table(args: argparse.Namespace, gpu: str, elapsed: float) -> str:
    lines = [f"GPU: {gpu}; torch {torch.__version__}; total {elapsed:.0f} s", ""]
    w1 = max(len(r[0]) for r in ROWS)
    w2 = max(len(r[1]) for r in ROWS)
    w3 = max(len(r[2]) for r in ROWS)
    for sec, item, val, note in ROWS:
        lines.append(f"{sec:<{w1}}  {item:<{w2}}  {val:>{w3}}  {note}")
    if ATTN_GRID:
        lines += ["", "decode attention, TB/s of K/V read (fraction of copy bandwidth):", *ATTN_GRID]
    text = "\n".join(lines)
    log("\n" + "=" * 100 + "\n" + text)
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3.1-8b,qwen2.5-0.5b")
    ap.add_argument("--sections", default="ceilings,attention,models")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument(
        "--num-requests-8b", type=int, default=0, help="requests for the 8B shape (0: --num-requests)"
    )
    add_workload_args(ap)
    ap.add_argument("--hf-batch-sizes", default="16,64")
    ap.add_argument("--hf-requests", type=int, default=32, help="requests transformers is timed on (scaled)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--b1-models", default="llama-3.1-8b,llama-3.1-70b")
    ap.add_argument(
        "--tp-compare-models",
        default="llama-3.1-8b",
        help="with --tensor-parallel-size > 1: shapes also run on one GPU (greedy equality, step ratio)",
    )
    ap.add_argument("--b1-prompt", type=int, default=128)
    ap.add_argument("--b1-steps", type=int, default=128)
    ap.add_argument("--check-prompt-lens", type=int, nargs="+", default=[17, 130, 431, 777])
    ap.add_argument("--check-tokens", type=int, default=64)
    ap.add_argument("--check-kv-blocks", type=int, default=512)
    ap.add_argument("--tie-tol", type=float, default=0.125, help="nats: 2 bf16 ulps of a logit in [8, 16)")
    ap.add_argument("--copy-mib", type=int, default=2048)
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--attn-batches", default="1,4,16,32,64,128,256")
    ap.add_argument("--attn-contexts", default="512,1024,2048,4096,8192")
    ap.add_argument("--attn-rotate-mib", type=int, default=256)
    ap.add_argument("--attn-reps", type=int, default=10)
    ap.add_argument(
        "--attn-splits-diag",
        default="1,2,4,8",
        help="for cells with batch >= 16 under 80%% of the copy bandwidth, also time these forced "
        "split-K counts ('' = off)",
    )
    ap.add_argument("--long-model", default="llama-3.1-8b")
    ap.add_argument("--long-context", type=int, default=32768)
    # Decode steps timed at the long context: 192 of them (64 to 256 tokens), ~1.2 s at 32k.
    ap.add_argument("--long-steps", type=int, default=256)
    ap.add_argument(
        "--long-configs",
        default="none:auto,none:fp8,fp8:fp8",
        help="quantization:kv_cache_dtype pairs the longctx section runs (none = the model's dtype)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and sizes: checks every code path runs")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for table.txt / results.json")
    args = ap.parse_args(argv)
    args.hf_batch_sizes = [int(x) for x in args.hf_batch_sizes.split(",") if x]
    args.b1_models = args.b1_models.split(",")
    args.tp_compare_models = args.tp_compare_models.split(",")
    args.attn_splits_diag = [int(x) for x in args.attn_splits_diag.split(",") if x]
    shapes = SHAPES
    if args.smoke:
        shapes = SMOKE_SHAPES
        args.models = ",".join(SMOKE_SHAPES)
        args.b1_models = args.tp_compare_models = ["llama-tiny"]
        args.num_requests, args.prompt_len, args.output_len = 6, [8, 40], [4, 12]
        args.hf_batch_sizes, args.hf_requests = [4], 4
        args.copy_mib, args.matmul_n = 16, 256
        args.attn_batches, args.attn_contexts, args.attn_rotate_mib, args.attn_reps = "1,32", "512,2048", 8, 2
        args.check_prompt_lens, args.check_tokens, args.check_kv_blocks = [5, 33], 8, 64
        args.b1_prompt, args.b1_steps, args.max_num_seqs = 8, 4, 8
        args.long_model, args.long_context, args.long_steps = "llama-tiny", 300, 4
    if args.smoke and args.device == "cuda" and not torch.cuda.is_available():
        args.device = "cpu"  # make test's smoke run (tests/benchmarks): every code path, interpreted
    if args.smoke and args.device == "cpu":  # Triton interpreted: one small attention cell
        args.attn_batches, args.attn_contexts, args.attn_rotate_mib, args.attn_reps = "1", "64", 1, 1
        args.attn_splits_diag, args.skip_transformers = [], True
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --smoke --device cpu for a dry run)")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    log(f"GPU: {gpu}")
    sections = args.sections.split(",")
    t_start = time.perf_counter()
    try:
        # Measured whatever the sections: a floor from an assumed bandwidth is no floor (an
        # assumed 3.0 TB/s once put an H200's size-1 step at "0.94x" its floor).
        copy_bw = copy_ceiling(args)
        if "ceilings" in sections:
            matmul_ceiling(args)
        if "longctx" in sections:
            from benchmarks.long_context import long_context_section

            with tempfile.TemporaryDirectory() as root:
                long_context_section(root, args, copy_bw, shapes)
        if "attention" in sections:
            try:
                attention_sweep(args, copy_bw)
            except Exception as e:
                traceback.print_exc()
                row("decode attention", "sweep", "ERROR", repr(e)[:120])
                free_cuda()
        if "models" in sections:
            with tempfile.TemporaryDirectory() as root:
                for name in args.models.split(","):
                    t0 = time.perf_counter()
                    try:
                        model_section(name, shapes[name], root, args, copy_bw)
                    except Exception as e:
                        traceback.print_exc()
                        row(name, "section", "ERROR", repr(e)[:160])
                        free_cuda()
                    log(f"== {name} took {time.perf_counter() - t0:.0f} s")
    finally:
        text = print_table(args, gpu, time.perf_counter() - t_start)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "table.txt"), "w") as f:
                f.write(text + "\n")
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(
                    {"gpu": gpu, "rows": ROWS, "attention_grid": ATTN_GRID, "args": vars(args)}, f, indent=1
                )
    if args.smoke and any(value == "ERROR" for _, _, value, _ in ROWS):
        sys.exit("smoke: a section failed (ERROR rows above)")


if __name__ == "__main__":
    main()
