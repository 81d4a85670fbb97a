"""Tensor-parallel all-reduce: the peer-to-peer one-shot path against NCCL, checked and timed.

    python3 benchmarks/tp_all_reduce.py [--size 2] [--dtype bfloat16] [--kib 16,64,256,1024,4096]

Starts `--size` rank processes (one per GPU), which open the worker's own group
(`worker_svc.parallel.open_group`, `tp_all_reduce="auto"`), then, for each message size:
1. check: seeded random messages (different on every rank) reduced by both paths; the sums must
   be equal to each other (exactly at two ranks, where a sum has one order) and on every rank;
2. time: 64 all-reduces of each path captured in one CUDA graph and replayed, as the decode
   graphs run them; microseconds per all-reduce (the median of 20 replays).
Rank 0 prints one table; the exit code is 1 if any check failed or the p2p path did not start.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.ports import free_port  # noqa: E402
from worker_svc.parallel import TensorParallel, open_group  # noqa: E402

REPEAT = 64


def _graph_us(fn, replays: int = 20) -> float:
    """Microseconds per call of `fn`, REPEAT calls captured in one graph, median of replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up outside the capture (NCCL and the kernels' first launches)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(REPEAT):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / REPEAT)
    return statistics.median(times)


def _nccl(tp: TensorParallel, x: torch.Tensor) -> None:
    tp.group.allreduce([x]).wait()  # type: ignore[union-attr]


def run_rank(rank: int, size: int, port: int, dtype: torch.dtype, kib: list[int]) -> int:
    device = torch.device("cuda", rank)
    store = None
    if rank == 0:
        from datetime import timedelta

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, size, is_master=True, timeout=timedelta(seconds=120))
    tp = open_group(rank, size, port, "nccl", 120.0, device, store, all_reduce="auto")
    failed = tp.p2p is None
    rows = []
    for k in kib:
        n = k * 1024 // dtype.itemsize
        gen = torch.Generator(device=device).manual_seed(1000 + rank)
        msg = torch.randn(n, generator=gen, device=device).to(dtype)
        if tp.p2p is None or not tp.p2p.fits(msg):
            rows.append((k, "-", "-", _graph_us(lambda m=msg.clone(): _nccl(tp, m)), None))
            continue
        a, b = msg.clone(), msg.clone()
        _nccl(tp, a)
        tp.p2p.all_reduce(b)
        torch.cuda.synchronize()
        exact = size == 2
        same = torch.equal(a, b) if exact else torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
        # Every rank must hold the same sum (the ranks' hidden states must not drift apart).
        mine = b.float().sum().reshape(1)
        ref = mine.clone()
        tp.broadcast_from_first(ref)
        same = same and torch.equal(mine, ref)
        failed |= not same
        p2p_buf, nccl_buf = msg.clone(), msg.clone()
        us_p2p = _graph_us(lambda m=p2p_buf: tp.p2p.all_reduce(m))  # type: ignore[union-attr]
        us_nccl = _graph_us(lambda m=nccl_buf: _nccl(tp, m))
        rows.append((k, "equal" if same else "DIFFER", us_p2p, us_nccl, us_nccl / us_p2p))
    flags = torch.tensor([int(failed)], device=device)
    tp.group.allreduce([flags]).wait()  # type: ignore[union-attr]
    if rank == 0:
        print(f"{torch.cuda.get_device_name(0)} x{size}; torch {torch.__version__}; {dtype}; "
              f"{REPEAT} all-reduces per graph")
        print(f"{'KiB':>6}  {'p2p check':>9}  {'p2p us':>7}  {'NCCL us':>7}  {'NCCL/p2p':>8}")
        for k, check, p2p, nccl, ratio in rows:
            p2p_s = f"{p2p:7.1f}" if isinstance(p2p, float) else f"{p2p:>7}"
            ratio_s = f"{ratio:7.2f}x" if ratio else f"{'-':>8}"
            print(f"{k:>6}  {check:>9}  {p2p_s}  {nccl:7.1f}  {ratio_s}")
        if tp.p2p is None:
            print("the peer-to-peer path did not start (see the log): NCCL only")
    tp.close()
    return 1 if int(flags.item()) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--kib", default="16,64,256,1024,4096,16384")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="make test: parse, then skip without CUDA")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    kib = [int(k) for k in args.kib.split(",")]
    if args.rank is not None:
        return run_rank(args.rank, args.size, args.port, dtype, kib)
    if args.smoke:  # make test (tests/benchmarks): the engines are GPU work of minutes, even on a GPU
        print(f"smoke: arguments parsed; the all-reduces ({args.size} CUDA devices) skipped")
        return 0
    if torch.cuda.device_count() < args.size:
        print(f"needs {args.size} CUDA devices, {torch.cuda.device_count()} visible")
        return 2
    port = free_port()
    base = [sys.executable, __file__, "--size", str(args.size), "--dtype", args.dtype, "--kib", args.kib]
    procs = [
        subprocess.Popen([*base, "--rank", str(r), "--port", str(port)], env=os.environ.copy())
        for r in range(args.size)
    ]
    codes = [p.wait(timeout=300) for p in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
