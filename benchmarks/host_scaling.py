"""What a host gives N copies of one CPU-bound job against one copy: the ceiling under issue 30's
"4 shards >= 3.5x one shard" that no software on that host can pass.

    .venv/bin/python benchmarks/host_scaling.py [--procs 1,4,8,16] [--seconds 5] [--jobs python,proto,memory]
    .venv/bin/python benchmarks/host_scaling.py --smoke    # a second, 2-core machine (make test)

shard_scaling.py measured the same shard code at 20.1 us of CPU a token alone on 4 cores of an
idle 16-core host and 25.4-27.7 us with the other 12 cores busy, and four fully isolated copies
of the 1-shard row (each on 4 cores of its own, its own clients, nothing shared but the host) at
2.80-3.22x the lone one. This script asks the same of jobs that share nothing at all: P processes,
each pinned to one CPU of its own (`cpu_order`: whole cores first), each running one job as fast
as it can for `--seconds`, all started together. Jobs:

  * `python`: the interpreter's own work on a cache-resident working set (dict and list churn,
    integer arithmetic): the shard core's planning loop in miniature;
  * `proto`: build, serialize and parse the response a scheduler streams per token
    (`GenerateResponse` with one token id), what the API processes and clients do
    per token;
  * `memory`: random reads over a 64 MiB list of Python ints (past any core's share of L3): the
    part of a job that shares the host's caches and memory bandwidth.

Reported per job and process count: operations a second per process, the aggregate, and the
aggregate against P copies of the lone process (1.00x: perfect scaling). The row that answers
issue 30's question is P = 16 against P = 4: four copies of a 4-core job against one, on this
host, the ratio `16 / 4` column.

`--pairs` then asks which CPUs slow each other down: a KVM guest may report 16 cores with "1
thread per core" whose vCPUs are SMT siblings on the host, so that two busy vCPUs of one
physical core each run at ~0.5-0.65x. It prints each CPU's worst partner and the order that
puts such pairs side by side, for shard_scaling.py's `--cpu-order`: a row's slice of the host
is then a slice of its physical cores, as cpu_order means it to be where sysfs tells the truth.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shard_scaling import cpu_order  # noqa: E402

JOBS = ("python", "proto", "memory")


def _python_job(deadline: float) -> int:
    """Dict and list churn over a few thousand keys: interpreter-bound, in cache."""
    ops = 0
    table: dict[int, list[int]] = {}
    while time.perf_counter() < deadline:
        for i in range(1000):
            key = (i * 2654435761) & 4095
            row = table.get(key)
            if row is None:
                table[key] = [i, i + 1]
            else:
                row.append(i)
                if len(row) > 8:
                    del table[key]
        ops += 1000
    return ops


def _proto_job(deadline: float) -> int:
    """A token's response message: built, serialized, parsed (the per-token wire work)."""
    from llmesh.v1 import generation_pb2 as pb

    ops = 0
    while time.perf_counter() < deadline:
        for i in range(200):
            msg = pb.GenerateResponse(request_id="req-0123456789abcdef")
            msg.token_ids.append(i)
            data = msg.SerializeToString()
            pb.GenerateResponse.FromString(data)
        ops += 200
    return ops


def _memory_setup(mib: int) -> tuple[list[int], list[int]]:
    """`mib` MiB of list slots (8 bytes a pointer, each to its own int) and 4,096 random indices."""
    n = mib * (1 << 20) // 8
    rng = random.Random(os.getpid())
    return list(range(n)), [rng.randrange(n) for _ in range(4096)]


def _memory_job(deadline: float, big: list[int], idx: list[int]) -> int:
    """Random reads over `big` (built before the clock starts, by `_memory_setup`)."""
    ops = 0
    acc = 0
    while time.perf_counter() < deadline:
        for j in idx:
            acc += big[j]
        ops += len(idx)
        idx = idx[1:] + idx[:1]  # a new order each pass, so the reads stay scattered
    return ops


def _worker(job: str, cpu: int, seconds: float, mib: int, barrier, results) -> None:
    os.sched_setaffinity(0, {cpu})
    memory = _memory_setup(mib) if job == "memory" else None  # built before the clock starts
    barrier.wait()
    deadline = time.perf_counter() + seconds
    if job == "python":
        ops = _python_job(deadline)
    elif job == "proto":
        ops = _proto_job(deadline)
    else:
        ops = _memory_job(deadline, *memory)
    results.put(ops / seconds)


def _pinned_loop(cpu: int, conn) -> None:
    """A worker of the pair probe: pinned to `cpu`, it runs the python job for each
    (start_at, seconds) it is sent, from start_at on, and answers its ops a second."""
    os.sched_setaffinity(0, {cpu})
    while True:
        ask = conn.recv()
        if ask is None:
            return
        start_at, seconds = ask
        while time.time() < start_at:
            pass
        conn.send(_python_job(time.perf_counter() + seconds) / seconds)


def probe_pairs(cpus: list[int], seconds: float) -> list[tuple[int, int | None, float]]:
    """Which CPUs slow each other down: hidden SMT siblings, where a hypervisor reports "1
    thread per core". Each CPU is timed alone, then each unpaired CPU with every later unpaired
    one at once; its partner is the one that slowed the two most, if they ran under 0.8x their
    lone rates (a real sibling pair runs at ~0.5-0.65x). Returns (cpu, partner or None, the
    pair's mean rate against alone)."""
    ctx = mp.get_context("spawn")
    pipes, procs = {}, []
    for c in cpus:
        pipes[c], child = ctx.Pipe()
        procs.append(ctx.Process(target=_pinned_loop, args=(c, child), daemon=True))
        procs[-1].start()

    def together(group: list[int]) -> list[float]:
        start_at = time.time() + 0.05
        for c in group:
            pipes[c].send((start_at, seconds))
        return [pipes[c].recv() for c in group]

    lone = {c: together([c])[0] for c in cpus}
    out: list[tuple[int, int | None, float]] = []
    left = list(cpus)
    while left:
        c = left.pop(0)
        best, best_ratio = None, 1.0
        for d in left:
            rc, rd = together([c, d])
            ratio = (rc / lone[c] + rd / lone[d]) / 2
            if ratio < best_ratio:
                best, best_ratio = d, ratio
        if best is not None and best_ratio < 0.8:
            left.remove(best)
            out.append((c, best, best_ratio))
        else:
            out.append((c, None, best_ratio))
    for c in cpus:
        pipes[c].send(None)
    for proc in procs:
        proc.join(timeout=5)
    return out


def run(job: str, cpus: list[int], seconds: float, mib: int) -> list[float]:
    """Each process's operations a second, P processes on `cpus` (one each), started together."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(cpus))
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(job, c, seconds, mib, barrier, results)) for c in cpus]
    for p in procs:
        p.start()
    rates = [results.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    return rates


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", default="1,4,8,16", help="process counts (capped at the host's CPUs)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--memory-mib", type=int, default=64)
    ap.add_argument(
        "--pairs", action="store_true", help="also probe which CPUs slow each other (hidden SMT siblings)"
    )
    ap.add_argument("--pair-seconds", type=float, default=0.4)
    ap.add_argument("--smoke", action="store_true", help="1 and 2 processes, 0.2 s each, two jobs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.procs, args.seconds, args.memory_mib, args.pairs, args.pair_seconds = "1,2", 0.2, 8, True, 0.1
        args.jobs = "python,proto"
    jobs = [j for j in args.jobs.split(",") if j]
    unknown = set(jobs) - set(JOBS)
    if unknown:
        ap.error(f"--jobs: unknown {sorted(unknown)}; choose from {list(JOBS)}")
    order = cpu_order()
    counts = sorted({min(int(p), len(order)) for p in args.procs.split(",") if p})
    print(f"host: {os.cpu_count()} CPUs, {len(order)} allowed; {args.seconds:g} s a row")
    head = f"{counts[-1]} / {counts[-1] // 4 or 1}"
    print(f"| job | processes | ops/s per process (min-max) | aggregate | vs P x lone | {head} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for job in jobs:
        agg: dict[int, float] = {}
        lone = 0.0
        for p in counts:
            rates = run(job, order[:p], args.seconds, args.memory_mib)
            agg[p] = sum(rates)
            if p == counts[0]:
                lone = agg[p] / p
            quarter = counts[-1] // 4 or 1
            ratio = f"{agg[p] / agg[quarter]:.2f}x" if p == counts[-1] and quarter in agg else ""
            print(
                f"| {job} | {p} | {min(rates):,.0f}-{max(rates):,.0f} | {agg[p]:,.0f} | "
                f"{agg[p] / (p * lone):.2f}x | {ratio} |",
                flush=True,
            )
    if args.pairs:
        pairs = probe_pairs(order, args.pair_seconds)
        print("\n| CPU | slowed most by | the pair's rate vs alone |\n| ---: | ---: | ---: |")
        for c, d, ratio in pairs:
            print(f"| {c} | {'-' if d is None else d} | {ratio:.2f}x |")
        core_order = [x for c, d, _ in pairs for x in ((c,) if d is None else (c, d))]
        print(f"\nsiblings side by side (shard_scaling.py --cpu-order): {','.join(map(str, core_order))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
