"""Disaggregated prefill/decode against aggregated workers: the same mixed workload, the same arrivals.

    python3 benchmarks/disaggregation.py --devices cuda:0,cuda:1 [--out DIR]     # two GPUs
    python3 benchmarks/disaggregation.py --smoke                                 # tiny, on the CPU

Rows (--rows), each a scheduler, a KV store (unless --no-store) and two workers as processes on
loopback (random weights of --shape, `--load-format dummy`), one worker per device of --devices:
* "aggregated": both workers serve whole requests (role both);
* "1P+1D": the first is a prefill worker, the second a decode worker; prompts of at least
  --threshold tokens are prefilled on the first and decoded on the second after the direct KV
  handover (the decode worker copies the prompt's blocks out of the prefill worker's cache: GPU to
  GPU through CUDA IPC, shared memory on the CPU; worker_svc/kv_peer.py), shorter ones run whole
  on the second;
* "1P+1D store": the same, the handover through the KV store (the scheduler's --no-direct-handover).
A 1P+1D row may name its queue rule (scheduler_svc/disaggregation.py): "1P+1D@Q:C" keeps a long
prompt on the decode worker, in chunks of C tokens, while the prefill worker's predicted wait is
over Q seconds and the decode worker is predicted to give its first token sooner (the scheduler's
--disaggregation-max-queue-s Q --disaggregation-local-chunk-tokens C; without a suffix, --max-queue-s
and --local-chunk-tokens); "1P+1D@off" sends every long prompt to the prefill worker.

The workload (seeded, the same schedule for both rows): decode-heavy chats (--chat-prompt,
--chat-output tokens) arriving at --chat-rate per second, and long prompts (--long-prompt tokens,
--long-output) at --long-rate among them. Per row: TTFT p50/p90 (every request), ITL p50/p99
(gaps between the streamed tokens of each request, stream interval 1), output tok/s, handovers,
fallbacks, direct handovers (and those whose copy failed), the KV bytes a direct handover copied
and the decode worker's host time issuing the copy (on CUDA the copy itself runs on its stream,
ahead of the forward), the prompt tokens the decode worker computed per handover (the tail
past the prompt's last whole store chunk, with the first token; 1 for a direct one), and the long
prompts the queue rule kept on the decode worker (`local`; every decision by reason in the JSON
and below the table). Greedy check:
--check prompts long enough to hand over, sent one at a time to every row: their tokens must be
equal to the first row's.

With two CUDA devices, first: the direct handover's own transport measured alone
(`peer_copy`): a process on the first device exports a --peer-gib paged cache
(`kv_peer.export_caches`, the handles as protobuf), a process that sees only the second device
(CUDA_VISIBLE_DEVICES, as the workers) opens it on its own device and copies every block
(`kv_peer.copy_blocks`), in order (slices) and shuffled (a gather and a scatter per layer), checked
against the source; if a process that sees one GPU cannot open a peer's handle, the workers are
given every GPU (--visible all) instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu import SHAPES, SMOKE_SHAPES, write_config  # noqa: E402


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


# ----- the workload -----
def workload(args: argparse.Namespace) -> list[tuple[float, list[int], int, str]]:
    """(arrival s, prompt, max_tokens, kind) in arrival order: Poisson chats and long prompts."""
    rng = random.Random(args.seed)
    vocab = args.vocab - 10
    reqs = []
    for kind, n, rate, plen, olen in (
        ("chat", args.chats, args.chat_rate, args.chat_prompt, args.chat_output),
        ("long", args.longs, args.long_rate, args.long_prompt, args.long_output),
    ):
        t = 0.0 if kind == "chat" else args.long_start_s
        for _ in range(n):
            prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(*plen))]
            reqs.append((t, prompt, rng.randint(*olen), kind))
            t += rng.expovariate(rate)
    return sorted(reqs, key=lambda r: r[0])


async def run_workload(address: str, reqs) -> list[dict[str, Any]]:
    import grpc

    from llmesh.v1 import generation_pb2 as g
    from llmesh.v1 import generation_pb2_grpc as gg
    from services.grpc_server import channel_options

    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub = gg.SchedulerStub(channel)
        start = time.perf_counter() + 0.5

        async def one(at: float, prompt: list[int], max_tokens: int, kind: str) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            req = g.GenerateRequest(
                prompt_token_ids=g.TokenIds(ids=prompt),
                sampling_params=g.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            )
            sent = time.perf_counter()
            stamps: list[tuple[float, int]] = []
            tokens: list[int] = []
            async for resp in stub.Generate(req):
                if resp.token_ids:
                    stamps.append((time.perf_counter(), len(resp.token_ids)))
                    tokens.extend(resp.token_ids)
            gaps = []
            for (t0, _), (t1, n) in zip(stamps, stamps[1:], strict=False):
                gaps += [(t1 - t0) / n] * n
            ttft = stamps[0][0] - sent if stamps else float("nan")
            return {"kind": kind, "ttft": ttft, "gaps": gaps, "tokens": tokens, "end": time.perf_counter()}

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(*r) for r in reqs))
        for o in outs:
            o["t0"] = t0
        return outs


async def one_at_a_time(address: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        outs.append(
            [t for o in await run_workload(address, [(0.0, p, max_tokens, "check")]) for t in o["tokens"]]
        )
    return outs


def scheduler_stats(address: str, security):
    from llmesh.v1 import worker_pb2, worker_pb2_grpc
    from services.grpc_server import open_sync_channel

    with open_sync_channel(address, security) as channel:
        return worker_pb2_grpc.RegistryStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=10)


def per_worker(args: argparse.Namespace) -> tuple[list[list[str]], list[dict[str, str]] | None]:
    """Each worker's flags and environment. On CUDA each sees only its GPU, as cuda:0
    (CUDA_VISIBLE_DEVICES, --visible own), as a deployment's pods do; a direct handover opens the
    peer's memory on the worker's own device. With --visible all each sees every GPU and is given
    its own (--device cuda:N). Two workers on one GPU split it (a worker's budget is its fraction
    of the device less what is in use there)."""
    devices = args.devices.split(",")
    if not args.cuda or (args.visible == "all" and devices[0] != devices[1]):
        return [["--device", d] for d in devices], None
    shared = devices[0] == devices[1]
    flags = [["--device", "cuda", *(["--gpu-memory-utilization", f"{0.42 * (i + 1):.2f}"] if shared else [])]
             for i in range(len(devices))]  # fmt: skip
    env = [{"CUDA_VISIBLE_DEVICES": d.partition(":")[2] or "0"} for d in devices]
    return flags, env


def queue_rule(name: str, args: argparse.Namespace) -> tuple[str, list[str]]:
    """A row's base name and the scheduler flags of its queue rule ("1P+1D@0.1:512", "1P+1D@off")."""
    base, _, rule = name.partition("@")
    q, c = (1e9, 0) if rule == "off" else (args.max_queue_s, args.local_chunk_tokens)
    if rule and rule != "off":
        q_s, _, c_s = rule.partition(":")
        q, c = float(q_s), int(c_s or c)
    flags = ["--disaggregation-max-queue-s", str(q), "--disaggregation-local-chunk-tokens", str(c)]
    return base, flags


def run_row(name: str, model: str, reqs, checks, args) -> dict[str, Any]:
    base, rule = queue_rule(name, args)
    worker_args = [
        "--load-format", "dummy", "--dtype", "bfloat16" if args.cuda else "float32",
        "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
        "--kv-chunk-tokens", str(args.chunk_tokens), "--kv-store-put-bytes", args.put_bytes,
        *(["--gpu-memory-utilization", "0.85"] if args.cuda else ["--kv-cache-memory", "64MiB"]),
        *args.worker_extra.split(),
    ]  # fmt: skip
    sched_args = [
        "--no-tokenizer", "--max-model-len", str(args.max_model_len),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--disaggregation-threshold", str(args.threshold), "--stream-interval", "1",
        "--handover-timeout-s", str(args.handover_timeout_s), *rule,
        *(["--no-direct-handover"] if base == "1P+1D store" else []),
    ]  # fmt: skip
    roles = None if base == "aggregated" else ["prefill", "decode"]
    with tempfile.TemporaryDirectory() as logs:
        try:
            return _measure_row(name, roles, model, reqs, checks, args, logs, worker_args, sched_args)
        except Exception:
            for f in sorted(os.listdir(logs)):  # what the services said (the folder goes with the row)
                with open(os.path.join(logs, f), errors="replace") as fh:
                    log(f"--- {name}: {f} ---\n{fh.read()[-3000:]}")
            raise


def _measure_row(name, roles, model, reqs, checks, args, logs, worker_args, sched_args) -> dict[str, Any]:
    from services.launcher import start_mesh

    mesh = start_mesh(
        2,
        model=model,
        worker_args=worker_args,
        scheduler_args=sched_args,
        kvstore=args.store,
        kvstore_args=["--memory-bytes", args.store_bytes],
        worker_roles=roles,
        per_worker_args=per_worker(args)[0],
        per_worker_env=per_worker(args)[1],
        log_dir=logs,
    )
    with mesh:
        addr = mesh.scheduler.address
        log(f"{name}: warming up")
        # Prompts of their own: the workload's must find no cache warm (nor the store).
        warm = [
            [(i * 7919 + j * 31) % (args.vocab - 10) + 5 for j in range(args.chat_prompt[0])]
            for i in range(4)
        ]
        asyncio.run(run_workload(addr, [(0.0, p, 4, "warm") for p in warm]))
        # And long ones (kernels compile for their shapes on first use; a handover in 1P+1D).
        for i, n in enumerate(args.long_prompt):
            long = [(i * 104729 + j * 17) % (args.vocab - 10) + 5 for j in range(n)]
            asyncio.run(run_workload(addr, [(0.0, long, 4, "warm"), *[(0.0, p, 8, "warm") for p in warm]]))
        before = scheduler_stats(addr, mesh.security)
        log(f"{name}: the workload ({len(reqs)} requests)")
        outs = asyncio.run(run_workload(addr, reqs))
        after = scheduler_stats(addr, mesh.security)
        greedy = asyncio.run(one_at_a_time(addr, checks, args.check_tokens))
    span = max(o["end"] for o in outs) - outs[0]["t0"]
    gaps = [gap for o in outs for gap in o["gaps"]]
    ttfts = [o["ttft"] for o in outs]
    handovers = after.pd_handovers - before.pd_handovers
    long_prompt_tokens = sum(len(p) for _, p, _, k in reqs if k == "long")
    loaded = sum(w.store_hit_tokens for w in after.workers) - sum(w.store_hit_tokens for w in before.workers)
    direct = after.pd_direct - before.pd_direct
    decisions = {k: n - before.pd_decisions.get(k, 0) for k, n in after.pd_decisions.items()}
    decisions = {k: n for k, n in sorted(decisions.items()) if n}
    tail_tokens = float("nan")
    if handovers:  # a direct handover computes the first token only; one through the store its tail too
        store_tail = long_prompt_tokens * (handovers - direct) / handovers - loaded
        tail_tokens = (store_tail + direct) / handovers
    return {
        "row": name,
        "requests": len(outs),
        "ttft_p50_ms": 1000 * pct(ttfts, 50),
        "ttft_p90_ms": 1000 * pct(ttfts, 90),
        "long_ttft_p90_ms": 1000 * pct([o["ttft"] for o in outs if o["kind"] == "long"], 90),
        "itl_p50_ms": 1000 * pct(gaps, 50),
        "itl_p99_ms": 1000 * pct(gaps, 99),
        "itl_p999_ms": 1000 * pct(gaps, 99.9),
        "stalls_100ms": sum(g > 0.1 for g in gaps),  # gaps a stream waited over 100 ms
        "out_tok_s": sum(len(o["tokens"]) for o in outs) / span,
        "handovers": handovers,
        "fallbacks": after.pd_fallbacks - before.pd_fallbacks,
        "handover_ms": 1000 * (after.pd_handover_seconds - before.pd_handover_seconds) / max(handovers, 1),
        "direct": direct,
        "direct_failed": after.pd_direct_failed - before.pd_direct_failed,
        "direct_mib": (after.pd_direct_bytes - before.pd_direct_bytes) / max(direct, 1) / (1 << 20),
        "copy_ms": 1000 * (after.pd_direct_copy_seconds - before.pd_direct_copy_seconds) / max(direct, 1),
        "tail_tokens": tail_tokens,
        "local": decisions.get("decode/queue_long", 0),
        "decisions": decisions,
        "greedy": greedy,
    }


# ----- GPU to GPU: the direct handover's transport alone -----
PEER_BLOCK = (16, 8, 128)  # block size, KV heads, head dim (llama-3.1-8b's blocks)


def peer_copy(devices: list[str], gib: float, layers: int, visible: str, repeats: int = 5) -> dict[str, Any]:
    """Export a `gib` paged cache on the first device, copy all of it from a process on the second
    (`_peer_consumer`: it sees only its GPU with `visible` "own"); GB/s in order and shuffled."""
    import subprocess

    import torch

    from services.convert import kv_export_to_proto
    from worker_svc.kv_peer import export_caches

    bs, heads, dim = PEER_BLOCK
    num_blocks = int(gib * (1 << 30)) // (layers * 2 * bs * heads * dim * 2)
    shape = (2, num_blocks, bs, heads, dim)
    src = [torch.randn(shape, device=devices[0]).to(torch.bfloat16) for _ in range(layers)]
    sums = [t.float().sum(dim=(0, 2, 3, 4)).tolist() for t in (src[0], src[-1])]  # per block, to check
    torch.cuda.synchronize(devices[0])
    export = export_caches(src, None)
    assert export is not None
    index = devices[1].partition(":")[2] or "0"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": index} if visible == "own" else dict(os.environ)
    device = "cuda:0" if visible == "own" else devices[1]
    header = json.dumps({"sums": sums, "repeats": repeats, "device": device}).encode()
    payload = kv_export_to_proto(export).SerializeToString()
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--peer-consumer"],
        input=len(header).to_bytes(8, "little") + header + payload,
        capture_output=True, env=env, timeout=300,
    )  # fmt: skip
    del src, export  # the workers that start next size their caches from what is free
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    if done.returncode != 0:
        raise RuntimeError(f"peer consumer ({visible}) failed: {done.stderr.decode()[-2000:]}")
    out = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return {"gib": gib, "layers": layers, "blocks": num_blocks, "visible": visible, **out}


def _peer_consumer() -> int:
    """The decode side of `peer_copy` (its own process): open the export, copy every block."""
    import random as _random

    import torch

    from llmesh.v1 import worker_pb2
    from services.convert import kv_export_from_proto
    from worker_svc.kv_peer import PeerCopier, copy_blocks, torch_dtype

    data = sys.stdin.buffer.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    export = kv_export_from_proto(worker_pb2.KVExport.FromString(data[8 + n :]))
    device = torch.device(header["device"])
    torch.cuda.set_device(device)
    shape, dtype = tuple(export.layer_shape), torch_dtype(export.dtype)
    dst = [torch.empty(shape, dtype=dtype, device=device) for _ in range(export.num_layers)]
    src = PeerCopier(dst, device)._peer(export)
    num_blocks = shape[1]
    nbytes = sum(t.numel() * t.element_size() for t in dst)
    out: dict[str, Any] = {"visible_gpus": torch.cuda.device_count()}
    for name, order in (
        ("in_order", list(range(num_blocks))),
        ("shuffled", _random.Random(0).sample(range(num_blocks), num_blocks)),
    ):
        best = 0.0
        for _ in range(header["repeats"]):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            copy_blocks(src, dst, order, list(range(num_blocks)))
            torch.cuda.synchronize(device)
            best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
        got = [t.float().sum(dim=(0, 2, 3, 4)).tolist() for t in (dst[0], dst[-1])]
        want = [[s[i] for i in order] for s in header["sums"]]
        out[name] = {"gb_s": best, "equal": got == want}
    print(json.dumps(out))
    return 0


# ----- main -----
def table(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("row", "{}"), ("requests", "{}"), ("ttft_p50_ms", "{:.0f}"), ("ttft_p90_ms", "{:.0f}"),
        ("long_ttft_p90_ms", "{:.0f}"), ("itl_p50_ms", "{:.1f}"), ("itl_p99_ms", "{:.1f}"),
        ("itl_p999_ms", "{:.0f}"), ("stalls_100ms", "{}"),
        ("out_tok_s", "{:.0f}"), ("handovers", "{}"), ("fallbacks", "{}"), ("handover_ms", "{:.1f}"),
        ("direct", "{}"), ("direct_failed", "{}"), ("direct_mib", "{:.1f}"), ("copy_ms", "{:.2f}"),
        ("tail_tokens", "{:.0f}"), ("local", "{}"),
    ]  # fmt: skip
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f.format(r[c]) for c, f in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--devices", default="cuda:0,cuda:1", help="the two workers' devices")
    ap.add_argument("--chats", type=int, default=200)
    ap.add_argument("--chat-rate", type=float, default=8.0, help="chats per second")
    ap.add_argument("--chat-prompt", type=int, nargs=2, default=[128, 512])
    ap.add_argument("--chat-output", type=int, nargs=2, default=[128, 256])
    ap.add_argument("--longs", type=int, default=75)
    ap.add_argument("--long-rate", type=float, default=3.0, help="long prompts per second")
    ap.add_argument("--long-start-s", type=float, default=0.5, help="when the first long prompt arrives")
    ap.add_argument("--long-prompt", type=int, nargs=2, default=[4096, 8192])
    ap.add_argument("--long-output", type=int, nargs=2, default=[32, 64])
    ap.add_argument("--threshold", type=int, default=1024, help="the scheduler's --disaggregation-threshold")
    ap.add_argument("--handover-timeout-s", type=float, default=3.0, help="the scheduler's")
    ap.add_argument(
        "--max-queue-s", type=float, default=0.05, help="the scheduler's --disaggregation-max-queue-s"
    )
    ap.add_argument(
        "--local-chunk-tokens", type=int, default=1536,
        help="the scheduler's --disaggregation-local-chunk-tokens (a decode worker's chunk bound)",
    )  # fmt: skip
    ap.add_argument("--chunk-tokens", type=int, default=256, help="the workers' --kv-chunk-tokens")
    ap.add_argument("--max-model-len", type=int, default=8448)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--put-bytes", default="8GiB", help="the workers' --kv-store-put-bytes")
    ap.add_argument("--store-bytes", default="24GiB", help="the KV store's --memory-bytes")
    ap.add_argument("--check", type=int, default=3, help="long prompts whose greedy tokens are compared")
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--peer-gib", type=float, default=1.0)
    ap.add_argument("--peer-layers", type=int, default=32)
    ap.add_argument("--rows", default="aggregated,1P+1D", help="of aggregated, 1P+1D, 1P+1D store")
    ap.add_argument(
        "--store", action=argparse.BooleanOptionalAction, default=True,
        help="a KV store behind every row (--no-store: none; a direct handover needs none)",
    )  # fmt: skip
    ap.add_argument(
        "--visible", choices=["own", "all", "auto"], default="auto",
        help="CUDA workers see their own GPU only (CUDA_VISIBLE_DEVICES) or all; auto: own if the "
        "peer copy works that way, else all",
    )  # fmt: skip
    ap.add_argument("--peer-consumer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--worker-extra", default="", help="more flags for every worker (e.g. --decode-gemm cublas)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, a few requests")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    if args.peer_consumer:
        return _peer_consumer()
    cfg = SHAPES[args.shape]
    if args.smoke:
        cfg = SMOKE_SHAPES["llama-tiny"]
        args.devices, args.chats, args.longs, args.chat_rate, args.long_rate = "cpu,cpu", 4, 2, 50.0, 20.0
        args.chat_prompt, args.chat_output, args.long_prompt, args.long_output = (
            [8, 16],
            [6, 10],
            [160, 200],
            [4, 6],
        )
        args.long_start_s, args.threshold, args.chunk_tokens, args.max_model_len = 0.05, 96, 32, 512
        args.max_num_seqs, args.max_num_batched_tokens, args.check, args.check_tokens = 16, 512, 1, 8
        args.put_bytes, args.store_bytes = "64MiB", "256MiB"
        if args.rows == ap.get_default("rows"):  # the queue rule's flags, a decode worker's chunk bound
            args.rows = "aggregated,1P+1D@0.1:32"
    args.cuda = args.devices.startswith("cuda")
    args.vocab = cfg["vocab_size"]
    reqs = workload(args)
    rng = random.Random(args.seed + 1)
    checks = [
        [rng.randrange(5, args.vocab - 10) for _ in range(args.long_prompt[0])] for _ in range(args.check)
    ]
    peer = None
    if args.cuda and len(set(args.devices.split(","))) == 2 and args.peer_gib > 0:
        peer = measure_peer(args)  # first: it decides --visible auto for the rows
    if args.visible == "auto":
        args.visible = "own"
    rows = []
    with tempfile.TemporaryDirectory() as root:
        model = write_config(root, args.shape if not args.smoke else "llama-tiny", cfg)
        for name in args.rows.split(","):
            t0 = time.perf_counter()
            try:
                rows.append(run_row(name, model, reqs, checks, args))
            except Exception as e:  # the other row still runs (one GPU call holds both)
                if args.smoke:
                    raise
                log(f"{name} failed: {e!r}")
                continue
            log(table(rows[-1:]), f"\n({time.perf_counter() - t0:.0f} s)")
    text = table(rows)
    for r in rows:
        if r["decisions"]:
            text += f"\n{r['row']}: decisions {r['decisions']}"
    for d in rows[1:]:
        a = rows[0]
        same = a["greedy"] == d["greedy"]
        text += (
            f"\n\n{d['row']} / {a['row']}: ITL p99 {a['itl_p99_ms'] / d['itl_p99_ms']:.2f}x lower, "
            f"TTFT p90 {d['ttft_p90_ms'] / a['ttft_p90_ms']:.2f}x; greedy ({len(checks)} prompts, one at a "
            f"time) {'identical' if same else 'DIFFERENT'}"
        )
    if peer is not None:
        text += f"\nGPU to GPU (kv_peer: CUDA IPC export, copy_blocks on the reader's device): {peer}"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "disaggregation.txt"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "disaggregation.json"), "w") as f:
            json.dump({"rows": rows, "peer": peer, "argv": sys.argv}, f)
    for r in rows:
        if r["handovers"] and args.smoke:
            assert r["fallbacks"] == 0 and r["direct_failed"] == 0, r
            assert r["direct"] == (r["handovers"] if r["row"].partition("@")[0] == "1P+1D" else 0), r
        if args.smoke:
            assert r["greedy"] == rows[0]["greedy"], r["row"]
    return 0


def measure_peer(args: argparse.Namespace) -> dict[str, Any] | None:
    """The transport alone, the workers' way first (each sees its own GPU), else seeing all."""
    tries = ["own", "all"] if args.visible == "auto" else [args.visible]
    for visible in tries:
        log(f"GPU to GPU through kv_peer (visible: {visible})")
        try:
            peer = peer_copy(args.devices.split(","), args.peer_gib, args.peer_layers, visible)
        except Exception as e:
            log(f"peer copy with visible={visible} failed: {e!r}")
            continue
        log(json.dumps(peer))
        args.visible = visible
        return peer
    return None


if __name__ == "__main__":
    raise SystemExit(main())
