"""The KV store between hosts: a prefix fetched over gRPC's Get stream against the bulk path.

A `llmesh kvstore` process on loopback (standing in for a store on another host: no shared
memory is used for the gets) is filled with `--entries` entries of `--entry-bytes` each in the
real entry format (default 256 x 4 MiB = 1 GiB), then the whole prefix is fetched
`--repeat` times (best kept) through

    grpc stream     KVStoreClient(shared_memory="off", bulk="off").get_each: 1 MiB protobuf pieces
    bulk, N conn    BulkClient(connections=N).get_many: sendmsg from the store's memory, recv_into
                    a new buffer per entry, N connections on N threads (no checksum)
    ..., staging    the same, recv_into slices of one buffer the caller made ahead (`alloc`: what
                    a worker's pinned staging buffer gets; no page faults on fresh memory)
    client, N conn  KVStoreClient(bulk="on").get_each over the bulk path, checksums checked
                    on the transfer threads (what a worker's load costs before its MAC check)

and prints GB/s (1e9 bytes/s) per path in one table. Issue 32's target: 1 GiB at >= 5 GB/s.

    .venv/bin/python benchmarks/kv_bulk.py [--entries 256] [--entry-bytes 4194304] [--connections 1,2,4]
    .venv/bin/python benchmarks/kv_bulk.py --smoke      # a few small entries, seconds
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from kvstore_svc.bulk import BulkClient  # noqa: E402
from kvstore_svc.client import KVStoreClient  # noqa: E402
from services.kv_entry import make_header  # noqa: E402
from services.launcher import free_port, grpc_serving, wait_until  # noqa: E402
from services.mesh_secret import client_key  # noqa: E402

FP = b"kv-bulk-benchmark-fingerprint-00"


def _entries(n: int, nbytes: int):
    """(key, header, payload) x n: float16 noise, each payload distinct (its first 8 bytes)."""
    base = np.random.default_rng(0).integers(0, 1 << 16, nbytes // 2, dtype=np.uint16)
    for i in range(n):
        data = base.copy()
        data[:4] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint16)
        payload = data.tobytes()
        header = make_header(FP, "float16", (2, nbytes // 4), "kv,elements", 16, payload)
        yield i.to_bytes(8, "little") * 4, header, payload


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=256)
    ap.add_argument("--entry-bytes", type=int, default=4 << 20)
    ap.add_argument("--connections", default="1,2,4", help="bulk connection counts to measure")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="8 entries of 64 KiB, once (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.entries, args.entry_bytes, args.repeat, args.connections = 8, 64 << 10, 1, "1,2"
    conns = [int(c) for c in args.connections.split(",")]
    total = args.entries * args.entry_bytes
    memory = max(64 << 20, int(total * 1.25))

    port = free_port()
    address = f"127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="kv-bulk-") as tmp:
        log_path = os.path.join(tmp, "kvstore.log")
        cmd = [
            sys.executable,
            "-m",
            "kvstore_svc.service",
            "--port",
            str(port),
            "--memory-bytes",
            str(memory),
        ]
        cmd += ["--max-entry-bytes", str(max(args.entry_bytes, 1 << 20)), "--log-level", "warning"]
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: grpc_serving(address), "kvstore", [proc], 60)
            rows = _measure(address, args, conns, total)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(
        f"\nKV prefix of {args.entries} x {args.entry_bytes / (1 << 20):g} MiB = {total / (1 << 30):.3g} GiB "
        f"from a store process on loopback, best of {args.repeat} ({os.cpu_count()} CPUs)\n"
    )
    print(f"| {'path':<26} | {'seconds':>8} | {'GB/s':>6} |")
    print(f"| {'-' * 26} | {'-' * 8}:| {'-' * 6}:|")
    for name, seconds in rows:
        print(f"| {name:<26} | {seconds:8.3f} | {total / seconds / 1e9:6.2f} |")
    return 0


def _measure(address: str, args: argparse.Namespace, conns: list[int], total: int) -> list[tuple[str, float]]:
    rows: list[tuple[str, float]] = []
    keys: list[bytes] = []
    with KVStoreClient(address, timeout_s=60) as filler:  # loopback: puts through shared memory
        batch = []
        for k, h, p in _entries(args.entries, args.entry_bytes):
            keys.append(k)
            batch.append((k, h, p))
            if len(batch) == 16:
                filler.put(FP, batch)
                batch = []
        if batch:
            filler.put(FP, batch)
        stats = filler.stats()
        assert filler.lookup(FP, keys) == len(keys), "the store did not keep the whole prefix"
        bulk_port = stats.bulk_port
        print(f"store: arena {stats.arena or '(heap)'}, bulk port {bulk_port}", flush=True)

    def fetch_each(client: KVStoreClient) -> None:
        got = 0

        def consume(k, h, p):
            nonlocal got
            got += len(p)

        n = client.get_each(FP, keys, consume)
        assert n == len(keys) and got == total, f"got {n} of {len(keys)} entries"

    with KVStoreClient(address, timeout_s=60, shared_memory="off", bulk="off") as grpc_client:
        rows.append(("grpc stream", _best(lambda: fetch_each(grpc_client), args.repeat)))
    key = client_key()
    staging = np.ones(total, dtype=np.uint8)  # touched: its pages exist, as a pinned buffer's do
    size = args.entry_bytes

    def alloc(i, header):
        return staging[i * size : i * size + header.payload_length]

    for n in conns:
        with BulkClient(("127.0.0.1", bulk_port), key, connections=n, timeout_s=60) as bulk:
            for name, fn in ((f"bulk, {n} conn", None), (f"bulk, {n} conn, staging", alloc)):

                def fetch(bulk=bulk, fn=fn) -> None:
                    got = bulk.get_many(FP, keys, alloc=fn)
                    assert all(g is not None for g in got), "bulk path missed entries"

                rows.append((name, _best(fetch, args.repeat)))
    n = max(conns)
    with KVStoreClient(address, timeout_s=60, shared_memory="off", bulk="on", bulk_connections=n) as client:
        rows.append((f"client (bulk), {n} conn", _best(lambda: fetch_each(client), args.repeat)))
    return rows


if __name__ == "__main__":
    sys.exit(main())
