"""Where a profiled window's device time goes: a torch.profiler (kineto) chrome trace read back.

    python -m benchmarks.trace_gaps trace.json[.gz] [--steps-kernel ArgMax] [--skip 2]

Prints, per step of the window (steps counted by a kernel that runs once a step, the greedy
argmax by default, the first `--skip` of them left out with the prefill): the device's busy time
(kernels, copies, memsets; overlaps merged), its idle time and where the idle lies (summed by the
device event that ended it), the kernels by total time, and the host's CUDA API calls by total
time (a cudaStreamSynchronize, cudaMemcpy or cudaFree that holds the host shows up here).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from typing import Any

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cuda_runtime", "cuda_driver"}


def load(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def analyse(events: list[dict[str, Any]], steps_kernel: str = "ArgMax", skip: int = 2, top: int = 12) -> str:
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS and "dur" in e), key=lambda e: float(e["ts"]))
    marks = [float(e["ts"]) for e in gpu if steps_kernel in e["name"]]
    if len(marks) <= skip + 1:
        return f"fewer than {skip + 2} '{steps_kernel}' kernels in the trace: no window"
    lo, hi = marks[skip], marks[-1]  # one step = from one mark to the next
    steps = len(marks) - 1 - skip
    win = [e for e in gpu if lo <= float(e["ts"]) < hi]
    # The host call that queued each device event (kernel launch, copy, graph launch).
    launch_of = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in HOST_CATS and "correlation" in e.get("args", {})
    }
    busy = idle = host_late = 0.0
    idle_before: dict[str, float] = defaultdict(float)
    gaps: list[tuple[float, str, str]] = []
    end, prev = lo, "(window start)"
    for e in win:
        ts, dur = float(e["ts"]), float(e["dur"])
        if ts > end:
            gap = ts - end
            idle += gap
            idle_before[_short(e["name"])] += gap
            call = launch_of.get(e.get("args", {}).get("correlation"))
            if call is not None and float(call["ts"]) + float(call["dur"]) > end:
                # Queued only after the device had run out of work: the host was late.
                host_late += min(gap, float(call["ts"]) + float(call["dur"]) - end)
            gaps.append((gap, _short(prev, 45), _short(e["name"], 45)))
        busy += max(0.0, ts + dur - max(ts, end))
        if ts + dur > end:
            end, prev = ts + dur, e["name"]
    if hi > end:
        idle += hi - end
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in win:
        k = by_kernel[_short(e["name"])]
        k[0] += float(e["dur"])
        k[1] += 1
    host = [e for e in events if e.get("cat") in HOST_CATS and "dur" in e and lo <= float(e["ts"]) < hi]
    by_api: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    for e in host:
        a = by_api[e["name"]]
        a[0] += float(e["dur"])
        a[1] += 1
        a[2] = max(a[2], float(e["dur"]))
    ms = 1e-3 / steps
    out = [
        f"window: {steps} steps, {(hi - lo) * ms:.3f} ms a step: device busy {busy * ms:.3f}, "
        f"idle {idle * ms:.3f} (of which the next work not yet queued: {host_late * ms:.3f})"
    ]
    out.append("  idle a step, by the device event that ended it:")
    for name, t in sorted(idle_before.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"    {t * ms:8.3f} ms  {name}")
    out.append("  longest gaps (us): after -> before")
    for gap, a, b in sorted(gaps, reverse=True)[:top]:
        out.append(f"    {gap:8.1f}  {a} -> {b}")
    out.append("  device events a step (ms, count):")
    for name, (t, n) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[: top * 2]:
        out.append(f"    {t * ms:8.3f}  {n / steps:5.1f}  {name}")
    out.append("  host CUDA API calls a step (ms, count, longest us):")
    for name, (t, n, longest) in sorted(by_api.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"    {t * ms:8.3f}  {n / steps:5.1f}  {longest:8.1f}  {name}")
    return "\n".join(out)


def step_times(events: list[dict[str, Any]], steps_kernel: str = "ArgMax") -> str:
    """Each step's device span (ms, from one `steps_kernel` to the next; the first is the step
    after the prefill's), the prefill's included: where a run's fixed costs land."""
    marks = sorted(
        float(e["ts"]) for e in events if e.get("cat") in GPU_CATS and steps_kernel in e.get("name", "")
    )
    return " ".join(f"{(b - a) / 1e3:.2f}" for a, b in zip(marks, marks[1:], strict=False))


def _smoke_events(steps: int = 6) -> list[dict[str, Any]]:
    """A made-up trace: per step a forward kernel, an upload queued late, the argmax."""
    events: list[dict[str, Any]] = []
    for i in range(steps):
        t = i * 200.0
        for j, (cat, name, ts, dur) in enumerate(
            (
                ("kernel", "gemm", t, 100.0),
                ("gpu_memcpy", "Memcpy HtoD", t + 120, 5.0),
                ("kernel", "ArgMax", t + 130, 10.0),
            )
        ):
            corr = i * 10 + j
            events.append({"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}})
            launch = ts - 1 if j == 1 else ts - 150  # the upload: queued only as the device idled
            events.append(
                {
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "ts": launch - 5,
                    "dur": 5.0,
                    "args": {"correlation": corr},
                }
            )
    return events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?")
    ap.add_argument("--steps-kernel", default="ArgMax")
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a made-up trace (make test)")
    args = ap.parse_args()
    if not args.smoke and args.trace is None:
        ap.error("a trace, or --smoke")
    events = _smoke_events() if args.smoke else load(args.trace)
    print(analyse(events, args.steps_kernel, args.skip))
    print("steps (ms):", step_times(events, args.steps_kernel))


if __name__ == "__main__":
    main()
