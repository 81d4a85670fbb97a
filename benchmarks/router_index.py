"""The router's prefix index and KV event path, measured: memory, event rates, routing time.

    .venv/bin/python benchmarks/router_index.py [--blocks 1000000] [--shards 4 64 256]
    .venv/bin/python benchmarks/router_index.py --smoke

Per shard count (router_svc/index.py, router_svc/core.py, scheduler_svc/kv_events.py):
- bytes per cached block in the router's index (tracemalloc over `--blocks` keys, each held by
  one shard, spread evenly: the usual case, a tenant's context on one shard);
- events per second the router applies (stored + removed keys, in batches of 64 as a planner
  step makes them), and that one scheduler publishes (its block manager's listener, netting,
  one flush per batch);
- routing time per request: hashing a `--prompt-len` prompt (the sha256 chain the workers use)
  alone, and the whole `Router.rank` (hashing, the index walk, overlap minus load per shard).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from router_svc.core import Router, RouterConfigView, ShardLoad  # noqa: E402
from router_svc.index import Batch, PrefixIndex  # noqa: E402
from scheduler_svc.kv_events import KVEventLog  # noqa: E402
from services.prefix_hash import extend_block_keys  # noqa: E402

BLOCK = 16


def index_bytes_per_block(blocks: int, shards: int) -> float:
    rng = random.Random(0)
    names = [f"s{i}" for i in range(shards)]
    tracemalloc.start()
    index = PrefixIndex()
    for name in names:
        index.bit(name)
    before = tracemalloc.get_traced_memory()[0]
    per = blocks // shards
    for name in names:  # the key ints are the index's own (made as the events are decoded)
        index.apply(name, (rng.getrandbits(64) for _ in range(per)), ())
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / (per * shards)


def router_events_per_s(shards: int, seconds: float = 0.5) -> float:
    rng = random.Random(1)
    index = PrefixIndex()
    names = [f"s{i}" for i in range(shards)]
    held: dict[str, list[int]] = {n: [rng.getrandbits(64) for _ in range(4096)] for n in names}
    for n in names:
        index.apply(n, held[n], ())
    events, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for n in names:
            new = [rng.getrandbits(64) for _ in range(32)]
            old, held[n] = held[n][:32], held[n][32:] + new
            index.apply(n, new, old)
            events += 64
    return events / (time.perf_counter() - start)


def scheduler_events_per_s(seconds: float = 0.5) -> float:
    log = KVEventLog("s")
    sub, _ = log.subscribe()
    workers = [log.worker(f"w{i}", BLOCK, b"fp") for i in range(2)]
    rng = random.Random(2)
    live: list[bytes] = []
    events, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        w = workers[events % 2]
        for _ in range(32):
            key = rng.getrandbits(256).to_bytes(32, "big")
            w.stored(key)
            live.append(key)
        for key in live[:-4096][:32]:
            w.removed(key)
        del live[: max(len(live) - 4096, 0)]
        log.flush()
        while not sub.queue.empty():
            sub.queue.get_nowait()
        events += 64
    return events / (time.perf_counter() - start)


def routing_ms(shards: int, prompt_len: int, reps: int) -> tuple[float, float]:
    """(hashing ms, whole routing ms) per request, the prompt's first 80% held by one shard."""
    router = Router(RouterConfigView(policy="index"))
    rng = random.Random(3)
    prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
    for i in range(shards):
        s = router.add_shard(f"s{i}", f"h:{i}")
        s.block_size, s.fingerprint = BLOCK, b"fp"
        router.set_connected(s, True)
        router.on_batch(
            s, Batch("e", 1, snapshot=True), ShardLoad(num_workers=2, queued_tokens=rng.randrange(5000))
        )
    keys = router.prompt_keys(prompt, "", BLOCK, b"fp")
    owner = router.shards["s0"]
    router.on_batch(owner, Batch("e", 2, stored=keys[: int(0.8 * len(keys))]))
    start = time.perf_counter()
    for _ in range(reps):
        extend_block_keys([], prompt, BLOCK, b"fp")
    hashing = (time.perf_counter() - start) / reps
    start = time.perf_counter()
    for _ in range(reps):
        router.rank(prompt)
    routing = (time.perf_counter() - start) / reps  # hashing included: what a request costs
    return 1000 * hashing, 1000 * routing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--shards", type=int, nargs="+", default=[4, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=4608)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    seconds = 0.5
    if args.smoke:
        args.blocks, args.shards, args.prompt_len, args.reps, seconds = 20_000, [4], 512, 3, 0.05
    print(f"{args.blocks:,} blocks in the index, {args.prompt_len}-token prompts, block size {BLOCK}")
    print(f"{'shards':>7}{'B/block':>9}{'router ev/s':>13}{'hash ms':>9}{'route ms':>9}")
    for shards in args.shards:
        per_block = index_bytes_per_block(args.blocks, shards)
        ev = router_events_per_s(shards, seconds)
        hashing, routing = routing_ms(shards, args.prompt_len, args.reps)
        print(f"{shards:>7}{per_block:>9.0f}{ev:>13,.0f}{hashing:>9.2f}{routing:>9.2f}")
    published = scheduler_events_per_s(seconds)
    print(f"\none scheduler publishes {published:,.0f} events/s (listener, netting, one flush per step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
