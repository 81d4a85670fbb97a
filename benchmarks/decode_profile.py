"""Where a batch-1 decode step's GPU time goes: the kernels of one CUDA-graph replay, by name.

    python3 benchmarks/decode_profile.py            # dummy Llama-3.1-8B on CUDA, ~1 min
    python3 benchmarks/decode_profile.py --context 32768 --kv-cache-dtype fp8 [--quantization fp8]

Replays the engine's batch-1 decode graph under the torch profiler (CUPTI records the graph's
kernels) and prints each kernel's time per replay, count and time per launch, then the eager
forward's host time for one 256-token prompt (the launch of a chunked prefill).

With programmatic dependent launch (on by default on sm90+) each kernel is launched while the
one before it runs and waits inside, so its recorded time counts that wait: the sum exceeds the
replay. `LLMESH_PDL=0` gives each kernel's own time (the replay line is then PDL-off's too).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gpu import SHAPES, add_workload_args, make_llm, write_config  # noqa: E402
from llmesh import SamplingParams  # noqa: E402


def set_context(llm, context: int) -> None:
    """Point the batch-1 graph's one row at `context` tokens of cache (blocks 0, 1, ...), writing
    nothing (slot -1): a decode step at that context, whatever the cache holds."""
    graphs = llm.engine.runner._graphs
    blocks = -(-context // llm.engine.runner.config.block_size)
    graphs.seq_lens[0] = context
    table = graphs.block_tables
    table[0, :blocks] = torch.arange(blocks, dtype=torch.int32, device=table.device)
    graphs.i64[2, 0] = -1


def graph_kernels(llm, replays: int = 10) -> None:
    graph = llm.engine.runner._graphs.graphs[1]
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"graph replay, batch 1: {start.elapsed_time(end) / 20 * 1e3:.0f} us")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_name[ev.name[:90]]
            entry[0] += 1
            entry[1] += ev.device_time
    total = sum(t for _, t in per_name.values())
    count = sum(n for n, _ in per_name.values())
    print(f"kernel time per replay: {total / replays:.0f} us over {count / replays:.0f} kernels")
    print("| us per replay | launches | us each | kernel |\n| ---: | ---: | ---: | --- |")
    for name, (n, t) in sorted(per_name.items(), key=lambda kv: -kv[1][1]):
        print(f"| {t / replays:.1f} | {n / replays:.1f} | {t / n:.2f} | {name} |")


def eager_forward_host_time(llm, tokens: int = 256) -> None:
    model = llm.engine.runner.model
    rng = random.Random(0)
    timed: list[tuple[float, float]] = []
    forward = model.forward

    def timed_forward(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        launched = time.perf_counter()
        torch.cuda.synchronize()
        timed.append((launched - t0, time.perf_counter() - t0))
        return out

    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = {"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(tokens)]}
    llm.generate([prompt], sp, use_tqdm=False)  # warm-up
    model.forward = timed_forward
    try:
        prompt = {"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(tokens)]}
        llm.generate([prompt], sp, use_tqdm=False)
    finally:
        del model.forward
    launch, whole = timed[0]
    print(
        f"eager forward, {tokens} tokens: launched in {launch * 1e3:.1f} ms, done after {whole * 1e3:.1f} ms"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument(
        "--context", type=int, default=0, help="context tokens of the step profiled (0: as generated)"
    )
    ap.add_argument("--smoke", action="store_true", help="make test: parse, then skip without CUDA")
    args = ap.parse_args(argv)
    if args.smoke:  # make test (tests/benchmarks): the engines are GPU work of minutes, even on a GPU
        print("smoke: arguments parsed; the profile (a CUDA graph under CUPTI) skipped")
        return
    args.max_num_seqs = min(args.max_num_seqs, 8)
    args.max_model_len = max(args.max_model_len, args.context + 256)
    llm = make_llm(write_config(tempfile.mkdtemp(), args.model, SHAPES[args.model]), args)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1000, 1128))}], sp, use_tqdm=False)
    if args.context:
        set_context(llm, args.context)
    graph_kernels(llm)
    eager_forward_host_time(llm)


if __name__ == "__main__":
    main()
