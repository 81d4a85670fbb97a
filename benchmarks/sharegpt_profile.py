"""Where a ShareGPT-shaped run's time goes, step by step (issue 31).

    python3 benchmarks/sharegpt_profile.py --out DIR [--passes events,profile,fine,events]
    python3 benchmarks/sharegpt_profile.py --smoke            # tiny shapes on the CPU (make test)

One in-process engine (dummy Llama-3.1-8B, bf16, `gpu_mesh.py --workload sharegpt`'s workload
and limits: 1,000 requests, 1,024 sequences, 16,384 batched tokens), warmed up, then one cold
`LLM.generate` of the whole workload per pass (each pass's prompts hold other token ids, same
lengths: nothing comes from the prefix cache). Every forward is recorded: its kind (a mixed /
prefill eager step, an eager decode, a decode graph replay and the graph size it pads to), its
tokens and sequences, the host time of `ModelRunner.launch` and of its forward call, and on
CUDA three events (before the forward, after it, after the sampling is queued), which give
each step's GPU time and the GPU's idle time before it. The planner's `schedule`/`update`
and the runner's `finish` (the wait for the sampled ids) are timed on the host.

Passes (`--passes`, in order):
* `events`: the decode graphs as captured by the engine padded up to the old power-of-two sizes;
* `fine`: the same with every captured size (`cuda_graphs.capture_sizes`); `fine-nogc` with
  the cycle collector off for the run (what its pauses cost: each pass reports the collections
  it met and the GPU's waits beside them); `-stacks` after a name samples every thread's stack
  each millisecond (`stack_sampler.py`) and prints where they stood during the launches the GPU
  waited for;
* any of them with `@` and settings of the decode graphs' paged attention, which are frozen
  into each graph at capture, so the graphs are captured again: `wN` split-K aiming at N waves
  of programs (`paged_attention._SPLIT_TARGET_WAVES`), `sN` N pipeline stages and `tN` context
  tiles of N tokens for pure-decode launches (`_pick_config`); `fine@w3,fine@w8s3` compares two
  settings on one engine;
* `profile`: as `events`, under the torch profiler (CUDA activity only); a marker kernel
  (`torch.cuda._sleep`) starts each forward, so each kernel is counted to its step's kind:
  time per kernel class (attention, GEMM, norm, SiLU-mul, rotary + KV write, sampling, the
  rest) for mixed steps and for decode replays, and the top kernels of each.

Prints one table per pass (out tok/s, GPU busy, per step kind: steps, mean sequences and
padded rows, GPU ms per step, idle before it, host ms per launch) and writes steps_<pass>.json
(every step) and summary.json under --out.
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu import SHAPES, SMOKE_SHAPES, engine_settings, free_cuda, write_config  # noqa: E402
from benchmarks.offline_throughput import make_sharegpt_workload  # noqa: E402
from benchmarks.stack_sampler import StackSampler  # noqa: E402
from worker_svc.rank_channel import DECODE_GRAPH, EAGER  # noqa: E402


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def pow2_sizes(max_num_seqs: int) -> list[int]:
    """The capture sizes before issue 31's ShareGPT work: powers of two, then the maximum."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def step_kind(rec: dict[str, Any]) -> str:
    if rec["mode"] == EAGER:
        return "mixed/prefill (eager)" if rec["max_q"] > 1 else "decode (eager)"
    if rec["mode"] != DECODE_GRAPH:
        return "verify (graph)"
    for hi in (16, 64, 128, 256, 512):
        if rec["n"] <= hi:
            return f"decode graph n<={hi}"
    return "decode graph n>512"


class StepRecorder:
    """Wraps one engine's runner, executor and planner with timers (instance attributes only)."""

    def __init__(self, llm: Any, cuda: bool) -> None:
        self.cuda = cuda
        self.marker = False
        self.rows: list[dict[str, Any]] = []
        self.host: dict[str, list[float]] = collections.defaultdict(list)
        self._cur: dict[str, Any] | None = None
        # Cycle collections, (perf_counter at start, ms, generation): they hold the GIL, so the
        # step thread cannot launch while one runs.
        self.collections: list[tuple[float, float, int]] = []
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)
        engine = llm.engine
        runner, ex, planner = engine.runner, engine.runner.executor, engine.planner
        self.ex = ex
        forward, launch, finish = ex.forward, runner.launch, runner.finish
        schedule, update = planner.schedule, planner.update

        def event() -> Any:
            if not self.cuda:
                return None
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

        def timed_forward(inp, patch=None, layer_ready=None):  # type: ignore[no-untyped-def]
            rec: dict[str, Any] = {
                "mode": inp.mode,
                "n": int(len(inp.seq_lens)),
                "tokens": int(len(inp.ids)),
                "max_q": int(inp.max_query_len),
                "ctx": int(inp.seq_lens.sum()),
            }
            if inp.mode == DECODE_GRAPH and ex.graphs is not None:
                rec["padded"] = ex.graphs.padded_size(rec["n"])
            if self.marker:
                torch.cuda._sleep(100)  # "spin_kernel": where this step's kernels start
            rec["e0"] = event()
            t0 = rec["t_forward"] = time.perf_counter()
            out = forward(inp, patch, layer_ready)
            rec["host_forward_ms"] = 1e3 * (time.perf_counter() - t0)
            rec["e1"] = event()
            self._cur = rec
            return out

        def timed_launch(plan):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = launch(plan)
            t1 = time.perf_counter()
            rec, self._cur = self._cur, None
            if rec is not None:
                rec["e2"] = event()
                rec["host_launch_ms"] = 1e3 * (t1 - t0)
                rec["t_launch"] = t0
                self.rows.append(rec)
            return out

        def timed(name: str, fn):  # type: ignore[no-untyped-def]
            def call(*a, **kw):  # type: ignore[no-untyped-def]
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.host[name].append(1e3 * (time.perf_counter() - t0))

            return call

        ex.forward = timed_forward
        runner.launch = timed_launch
        runner.finish = timed("runner.finish (waits for the sampled ids)", finish)
        planner.schedule = timed("planner.schedule", schedule)
        planner.update = timed("planner.update", update)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            ms = 1e3 * (time.perf_counter() - self._gc_start)
            self.collections.append((self._gc_start, ms, info["generation"]))

    def reset(self) -> None:
        self.rows = []
        self.host = collections.defaultdict(list)
        self.collections = []

    def resolve(self) -> list[dict[str, Any]]:
        """Each step's GPU times from its events (after the run: every event has completed)."""
        if self.cuda:
            torch.cuda.synchronize()
        prev = None
        out = []
        for rec in self.rows:
            e0, e1, e2 = rec.pop("e0"), rec.pop("e1"), rec.pop("e2")
            if self.cuda:
                rec["gpu_forward_ms"] = e0.elapsed_time(e1)
                rec["gpu_sample_ms"] = e1.elapsed_time(e2)
                rec["idle_before_ms"] = prev.elapsed_time(e0) if prev is not None else 0.0
            prev = e2
            rec["kind"] = step_kind(rec)
            out.append(rec)
        return out


def summarize(
    steps: list[dict[str, Any]],
    host: dict[str, list[float]],
    seconds: float,
    collections_seen: list[tuple[float, float, int]],
) -> dict[str, Any]:
    kinds: dict[str, dict[str, float]] = {}
    for rec in steps:
        k = kinds.setdefault(rec["kind"], collections.defaultdict(float))
        k["steps"] += 1
        for key in ("n", "tokens", "ctx", "padded", "gpu_forward_ms", "gpu_sample_ms", "idle_before_ms"):
            k[key] += rec.get(key, 0.0)
        k["host_launch_ms"] += rec["host_launch_ms"]
        k["host_forward_ms"] += rec["host_forward_ms"]
    busy = sum(r.get("gpu_forward_ms", 0.0) + r.get("gpu_sample_ms", 0.0) for r in steps) / 1e3
    return {
        "seconds": seconds,
        "steps": len(steps),
        "steps_per_s": len(steps) / seconds,
        "gpu_busy_s": busy,
        "gpu_idle_between_steps_s": sum(r.get("idle_before_ms", 0.0) for r in steps) / 1e3,
        "kinds": {k: dict(v) for k, v in kinds.items()},
        "host": {k: {"calls": len(v), "total_s": sum(v) / 1e3, "max_ms": max(v)} for k, v in host.items()},
        "gc": gc_summary(collections_seen),
        "idle_spikes": idle_spikes(steps, collections_seen),
    }


def gc_summary(seen: list[tuple[float, float, int]]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for _, ms, gen in seen:
        g = out.setdefault(gen, {"count": 0, "total_ms": 0.0, "max_ms": 0.0})
        g["count"] += 1
        g["total_ms"] += ms
        g["max_ms"] = max(g["max_ms"], ms)
    return dict(sorted(out.items()))


def idle_spikes(steps: list[dict[str, Any]], seen: list[tuple[float, float, int]], ms: float = 10.0) -> str:
    """How many steps the GPU waited more than `ms` for, and how many of those launches a cycle
    collection overlapped or ended within 50 ms before."""
    spikes = [r for r in steps if r.get("idle_before_ms", 0.0) > ms]
    near = 0
    for r in spikes:
        t0, t1 = r["t_launch"] - 0.05, r["t_launch"] + r["host_launch_ms"] / 1e3
        near += any(start < t1 and start + d / 1e3 > t0 for start, d, _ in seen)
    idle = sum(r["idle_before_ms"] for r in spikes)
    return f"{len(spikes)} waits over {ms:.0f} ms ({idle:.0f} ms), {near} of them beside a collection"


def kinds_table(s: dict[str, Any]) -> str:
    lines = [
        f"{'step kind':<24}{'steps':>7}{'seqs':>7}{'padded':>8}{'tokens':>8}{'GPU fwd ms':>11}"
        f"{'sample ms':>10}{'idle ms':>9}{'GPU s':>8}{'idle s':>8}{'host launch ms':>16}{'host fwd ms':>12}"
    ]
    for name, k in sorted(s["kinds"].items()):
        n = k["steps"]
        gpu_s = (k["gpu_forward_ms"] + k["gpu_sample_ms"]) / 1e3
        lines.append(
            f"{name:<24}{n:>7.0f}{k['n'] / n:>7.0f}{k['padded'] / n:>8.0f}{k['tokens'] / n:>8.0f}"
            f"{k['gpu_forward_ms'] / n:>11.2f}{k['gpu_sample_ms'] / n:>10.2f}{k['idle_before_ms'] / n:>9.2f}"
            f"{gpu_s:>8.2f}{k['idle_before_ms'] / 1e3:>8.2f}{k['host_launch_ms'] / n:>16.2f}"
            f"{k['host_forward_ms'] / n:>12.2f}"
        )
    host = ", ".join(
        f"{k} {v['total_s']:.2f} s / {v['calls']} (longest {v['max_ms']:.1f} ms)"
        for k, v in s["host"].items()
    )
    lines.append(f"host (all threads): {host}")
    gc_line = ", ".join(
        f"gen{g} {v['count']} = {v['total_ms']:.0f} ms (longest {v['max_ms']:.1f})"
        for g, v in s["gc"].items()
    )
    lines.append(f"cycle collections: {gc_line or 'none'}; {s['idle_spikes']}")
    return "\n".join(lines)


def stacks_table(sampler: StackSampler, steps: list[dict[str, Any]], ms: float = 8.0) -> str:
    """What the threads were doing before the forwards the GPU waited more than `ms` for: from
    the end of the launch before to this forward's call."""
    windows = [
        (prev["t_launch"] + prev["host_launch_ms"] / 1e3, r["t_forward"])
        for prev, r in itertools.pairwise(steps)
        if r.get("idle_before_ms", 0.0) > ms
    ]
    n, longest = sampler.gaps()
    lines = [
        f"stacks before {len(windows)} forwards the GPU waited over {ms:.0f} ms for"
        f" ({sum(b - a for a, b in windows) * 1e3:.0f} ms of host time; {len(sampler.samples)} samples;"
        f" the sampler kept from the GIL over 5 ms {n} times, longest {longest * 1e3:.1f} ms):"
    ]
    lines += [
        f"  {count:>5} {thread[:18]:<18} {sig}" for thread, sig, count in sampler.during(windows, top=25)
    ]
    # Where a large step's launch spends its host time (it is on the critical path there).
    large = [(r["t_launch"], r["t_launch"] + r["host_launch_ms"] / 1e3) for r in steps if r["n"] > 512]
    lines.append(
        f"the step thread during the {len(large)} launches of more than 512 sequences"
        f" ({sum(b - a for a, b in large) * 1e3:.0f} ms):"
    )
    lines += [
        f"  {count:>5} {sig}"
        for thread, sig, count in sampler.during(large, top=40)
        if thread == "llmesh-step"
    ]
    return "\n".join(lines)


# ----- kernels (the profile pass) -----
_CLASSES = [
    ("attention", ("paged_attn", "paged_decode", "_merge", "prefill_attn", "flash", "fmha", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "skinny", "splitk", "matmul", "sm90_")),
    ("norm", ("rms",)),
    ("silu_mul", ("silu",)),
    ("rotary+kv", ("rotary", "kv_write", "write_kv")),
    ("sampling", ("argmax", "ArgMax", "sampl", "softmax", "topk", "sort", "gumbel", "exponential")),
    ("fp8 quant", ("quant", "fp8")),
    ("memcpy/memset", ("Memcpy", "Memset")),
]


def kernel_class(name: str) -> str:
    for cls, keys in _CLASSES:
        if any(k in name for k in keys):
            return cls
    return "other"


def kernel_breakdown(prof: Any, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Kernel time per (step kind, class) and the top kernels per kind, from the marker kernels."""
    kernels = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            kernels.append((e.start_ns(), e.duration_ns(), e.name()))
    kernels.sort()
    if not kernels:
        return {}
    dd = collections.defaultdict
    by_class: dict[str, dict[str, float]] = dd(lambda: dd(float))
    by_name: dict[str, dict[str, list[float]]] = dd(lambda: dd(list))
    step = -1
    kind = "before the first step"
    for _, dur, name in kernels:
        if name.startswith("spin_kernel") or "spin_kernel" in name:
            step += 1
            kind = steps[step]["kind"] if step < len(steps) else "after the last step"
            continue
        by_class[kind][kernel_class(name)] += dur / 1e6
        by_name[kind][name[:90]].append(dur / 1e3)
    span_s = (kernels[-1][0] + kernels[-1][1] - kernels[0][0]) / 1e9
    total_s = sum(d for _, d, _ in kernels) / 1e9
    top = {
        kind: sorted(
            ((n, sum(v) / 1e3, len(v), sum(v) / len(v)) for n, v in names.items()), key=lambda x: -x[1]
        )[:12]
        for kind, names in by_name.items()
    }
    return {
        "markers": step + 1,
        "span_s": span_s,
        "kernel_s": total_s,
        "by_class_ms": {k: dict(v) for k, v in by_class.items()},
        "top": top,
    }


def kernels_table(b: dict[str, Any]) -> str:
    if not b:
        return "(no CUDA kernels recorded)"
    classes = [c for c, _ in _CLASSES] + ["other"]
    lines = [
        f"kernels: {b['kernel_s']:.2f} s over a {b['span_s']:.2f} s span"
        f" ({b['kernel_s'] / b['span_s']:.0%} busy), {b['markers']} steps marked",
        f"{'step kind':<24}" + "".join(f"{c[:12]:>13}" for c in classes) + f"{'all s':>9}",
    ]
    for kind, ms in sorted(b["by_class_ms"].items()):
        cells = "".join(f"{ms.get(c, 0.0) / 1e3:>13.3f}" for c in classes)
        lines.append(f"{kind:<24}{cells}{sum(ms.values()) / 1e3:>9.2f}")
    for kind, rows in sorted(b["top"].items()):
        lines.append(f"-- top kernels, {kind}: total ms, count, mean us")
        lines += [f"   {n:<90}{t:>10.1f}{c:>8}{m:>10.1f}" for n, t, c, m in rows]
    return "\n".join(lines)


# ----- the run -----
_PICK_CONFIG: Any = None  # paged_attention._pick_config as shipped


def recapture(llm: Any, settings: str) -> Any:
    """The decode graphs captured again with the attention settings `settings` (e.g. "w8s3"; see
    the module doc), between runs. Settings not named keep their shipped values."""
    import dataclasses
    import importlib
    import re

    from worker_svc.device_memory import release_graphs

    # The module, not the function of the same name that kernels.triton exports.
    pa = importlib.import_module("kernels.triton.paged_attention")

    global _PICK_CONFIG
    if _PICK_CONFIG is None:
        _PICK_CONFIG = (pa._pick_config, pa._SPLIT_TARGET_WAVES)
    pick, waves = _PICK_CONFIG
    knobs = {k: int(v) for k, v in re.findall(r"([wst])(\d+)", settings)}
    pa._SPLIT_TARGET_WAVES = knobs.get("w", waves)
    decode = {f: knobs[k] for k, f in (("s", "num_stages"), ("t", "tile")) if k in knobs}

    def pick_config(max_query_len: int, *a: Any, **kw: Any) -> Any:
        cfg = pick(max_query_len, *a, **kw)
        return dataclasses.replace(cfg, **decode) if max_query_len == 1 and decode else cfg

    pa._pick_config = pick_config
    ex = llm.engine.runner.executor
    release_graphs(ex)
    free_cuda()
    t0 = time.time()
    ex.capture_graphs()
    log(f"decode graphs captured again with {settings} ({knobs}) in {time.time() - t0:.1f} s")
    return ex.graphs


def shifted(reqs: list, k: int, vocab: int) -> list:
    """The same lengths with other token ids (a cold prefix cache for pass k)."""
    if k == 0:
        return reqs
    lo, span = 100, vocab - 101
    return [([(t - lo + 7919 * k) % span + lo for t in p], o) for p, o in reqs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--passes", default="events,profile,fine", help="comma-separated: events, fine, profile")
    ap.add_argument("--budget-s", type=float, default=240.0, help="start no pass after this many seconds")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    shapes = {**SHAPES, **SMOKE_SHAPES}
    if args.smoke:
        args.model, args.num_requests, args.max_num_seqs, args.max_num_batched_tokens = "llama-tiny", 4, 4, 64
        args.max_model_len, args.passes = 256, "events-nogc,fine-stacks@w8"
        if not torch.cuda.is_available():
            args.device = "cpu"
    cuda = args.device == "cuda"
    args.decode_gemm, args.tensor_parallel_size, args.tp_all_reduce = "auto", 1, "auto"
    cfg = shapes[args.model]
    reqs = make_sharegpt_workload(args.num_requests, cfg["vocab_size"], args.seed)
    if args.smoke:
        reqs = [(p[:24], min(o, 6)) for p, o in reqs]
    out_tokens = sum(o for _, o in reqs)
    t_start = time.time()
    summary: dict[str, Any] = {"args": vars(args), "passes": {}}
    from llmesh import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as root:
        path = write_config(root, args.model, cfg)
        llm = LLM(path, async_scheduling=True, **engine_settings(args))
        graphs = llm.engine.runner.executor.graphs
        all_sizes = list(graphs.sizes) if graphs is not None else []
        summary["capture"] = {"sizes": all_sizes, "seconds": graphs.capture_seconds if graphs else 0.0}
        log(f"engine up in {time.time() - t_start:.0f} s; capture sizes {all_sizes}")
        rec = StepRecorder(llm, cuda)
        try:
            warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            llm.generate([{"prompt_token_ids": p} for p, _ in reqs[:32]], warm, use_tqdm=False)
            params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
            last_settings = ""  # as the engine captured them
            for i, label in enumerate(args.passes.split(",")):
                if time.time() - t_start > args.budget_s:
                    log(f"skipping pass {label}: past --budget-s")
                    continue
                name, _, settings = label.partition("@")
                if settings and graphs is not None and settings != last_settings:
                    graphs = recapture(llm, settings)
                    last_settings = settings
                if graphs is not None:  # `fine`: every captured size; else the old powers of two
                    old = pow2_sizes(graphs.max_size)
                    fine = name.startswith("fine")
                    graphs.sizes = all_sizes if fine else [s for s in all_sizes if s in old]
                work = shifted(reqs, i + 1, cfg["vocab_size"])
                rec.reset()
                rec.marker = name == "profile" and cuda
                prof = None
                if rec.marker:
                    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    prof.__enter__()
                if "-nogc" in name:  # no cycle collection at all during the run
                    gc.disable()
                sampler = StackSampler() if "-stacks" in name else None
                if sampler is not None:
                    sampler.start()
                t0 = time.perf_counter()
                try:
                    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
                finally:
                    gc.enable()
                    if sampler is not None:
                        sampler.stop()
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if prof is not None:
                    prof.__exit__(None, None, None)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                assert tokens == out_tokens, (tokens, out_tokens)
                steps = rec.resolve()
                s = summarize(steps, rec.host, dt, rec.collections)
                s["out_tok_s"] = tokens / dt
                s["graph_sizes"] = list(graphs.sizes) if graphs is not None else []
                head = (
                    f"== pass {i + 1} `{label}`: {dt:.2f} s, {tokens / dt:,.0f} out tok/s, {len(steps)} steps"
                    f" ({s['steps_per_s']:.0f}/s), GPU busy {s['gpu_busy_s']:.2f} s"
                    f" = {s['gpu_busy_s'] / dt:.0%}, idle between steps {s['gpu_idle_between_steps_s']:.2f} s"
                )
                text = [head, kinds_table(s)]
                if sampler is not None:
                    text.append(stacks_table(sampler, steps))
                if prof is not None:
                    t_k = time.time()
                    b = kernel_breakdown(prof, steps)
                    s["kernels"] = b
                    text.append(kernels_table(b))
                    log(f"(kernel breakdown in {time.time() - t_k:.0f} s)")
                    del prof
                print("\n".join(text), flush=True)
                summary["passes"][f"{i + 1}:{label}"] = s
                if args.out:
                    os.makedirs(args.out, exist_ok=True)
                    stem = f"steps_{i + 1}_{label.replace('@', '_')}"
                    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
                        json.dump(steps, f, default=str)
        finally:
            llm.engine.close()
            del llm
            free_cuda()
    if args.out:
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    print(f"({time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
