"""KV tiers against recompute: TTFT and throughput, side by side in one run.

Workloads (greedy; every path is checked to give the recompute path's tokens):
- long shared document: a `--prefix` token document + a short question, the
  document computed once by one engine, then asked about by a fresh engine (a
  cold GPU cache, as on another worker) that loads it from a tier:
    recompute         nothing below the GPU cache
    worker CPU tier   the same engine, its GPU cache too small to keep the document
    store (process)   the store's core in this process (no gRPC: the floor of the store path)
    store (memory)    a `llmesh kvstore` service on loopback, memory tier, payloads streamed
                      over gRPC; then through the worker's shared memory segments
                      (GetShared/PutShared, a store without an arena); then read in place
                      from the store's shared memory arena (GetInPlace, the default)
    store (redis)     a `llmesh kvstore` service whose only tier is a real redis-server
    store over bulk   the service as if on another host (kv_store_transfer="bulk": another
                      process, no shared memory): payloads over its bulk TCP path straight into
                      the worker's pinned staging, one DMA per round to the GPU (issue 32)
  Store rows load behind the scheduler's load predictor (a hit is loaded only as far as it is
  predicted faster than recompute); each asker first loads `--warm-loads` other documents, so
  the predictor has measured its path, as a worker that has served has. `--predictor-off-too`
  adds the gRPC and bulk rows with the predictor off (every hit loaded). `--paired` keeps the
  recompute engine alive and times it on each prompt right before the row's engine does (the
  "vs paired" columns: a store row against recompute at the same moment of the run, not against
  the first row of the process), and adds a row "no store (prefix caching on)": the store rows'
  engine without a store, which tells the store's cost from the prefix cache's;
- the same documents through the mesh (`--mesh`): a scheduler, a worker and the KV store each a
  process, the worker reading the store over its bulk path (another host's case: no shared memory
  and no GIL shared with the scheduler), against a second mesh without a store alive beside it,
  timed on each prompt just before (paired); TTFT is the first token on the scheduler's Generate
  stream;
- multi-round chat: users whose histories grow every round, served by two
  engines in turn (as a router without stickiness would): out tok/s with and
  without the store;
- random prompts (nothing to reuse): out tok/s with the store on and off.

    .venv/bin/python benchmarks/kv_store.py [--prefix 2048] [--device cpu|cuda] [--load-format dummy]
        [--stores process,grpc,segments,inplace,redis,bulk] [--predictor-off-too] [--skip-host-tier]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu import SHAPES, SMOKE_SHAPES, write_config  # noqa: E402

from llmesh import LLM, SamplingParams  # noqa: E402
from llmesh.kv_store import open_kv_store  # noqa: E402
from services.launcher import free_port  # noqa: E402

FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def release() -> None:
    """Let a deleted engine's memory go before the next one is made (one model on the GPU at a time)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        if FREE_PINNED:
            torch._C._host_emptyCache()


# --variants: the store rows (and the mesh rows) again with diagnostic switches of the worker's
# KV store memory (worker_svc/kv_diagnostics), set in this process's environment (the mesh's
# children inherit it) while the row's engines start: which page-locked memory slows a worker
# that loads nothing (issue 32). "freepinned" empties torch's cache of pinned host memory
# whenever an engine is let go (a closed writer's 2 GiB put staging stays cached, pinned, otherwise).
VARIANTS: dict[str, dict[str, str]] = {
    "base": {},
    "noarena": {"LLMESH_KV_DIAG_NO_ARENA_LOCK": "1"},
    "noseg": {"LLMESH_KV_DIAG_NO_SEGMENT_LOCK": "1"},
    "pageload": {"LLMESH_KV_DIAG_PAGEABLE_LOAD": "1"},
    "pageput": {"LLMESH_KV_DIAG_PAGEABLE_PUT": "1"},
    "nopin": {
        "LLMESH_KV_DIAG_NO_ARENA_LOCK": "1",
        "LLMESH_KV_DIAG_NO_SEGMENT_LOCK": "1",
        "LLMESH_KV_DIAG_PAGEABLE_LOAD": "1",
        "LLMESH_KV_DIAG_PAGEABLE_PUT": "1",
    },
    "freepinned": {},
}
FREE_PINNED = False  # release() also empties torch's pinned host cache (the "freepinned" variant)


@contextlib.contextmanager
def variant(name: str) -> Iterator[str]:
    """Run a row under variant `name`; yields the suffix of its rows' names."""
    global FREE_PINNED
    switches = VARIANTS[name]
    saved = {k: os.environ.get(k) for k in switches}
    os.environ.update(switches)
    FREE_PINNED = name == "freepinned"
    try:
        yield "" if name == "base" else f" [{name}]"
    finally:
        FREE_PINNED = False
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_VMSTAT_KEYS = ("compact_", "thp_", "numa_", "pgmigrate", "pgfault", "pgmajfault")


def _process_counters() -> dict[str, int]:
    """This process's faults and context switches, and the host's compaction / THP / NUMA
    counters (/proc/vmstat): what a process-wide slowdown leaves behind."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {"minflt": ru.ru_minflt, "majflt": ru.ru_majflt, "nvcsw": ru.ru_nvcsw, "nivcsw": ru.ru_nivcsw}
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out["threads"] = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0
    for tid in os.listdir("/proc/self/task") if out["threads"] else []:
        with contextlib.suppress(OSError, IndexError, ValueError):  # a thread that just ended
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[f"cpu.{names.get(int(tid), 'native')}.{tid}"] = int(fields[11]) + int(fields[12])
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # The caching allocator: cudaMalloc / cudaFree calls and retries (a free-and-retry
        # synchronizes), shared by every engine of the process.
        stats = torch.cuda.memory_stats()
        for key in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams"):
            out["cuda." + key] = int(stats.get(key, 0))
    with contextlib.suppress(OSError):
        with open("/proc/vmstat") as f:
            for line in f:
                key, value = line.split()
                if key.startswith(_VMSTAT_KEYS):
                    out["vm." + key] = int(value)
    return out


def _counter_line(before: dict[str, int], after: dict[str, int], n: int) -> str:
    """Per-request deltas of the counters that moved; the threads (OS threads, then the three
    that ran the most beside the caller's, in clock ticks over the row)."""
    cpu = sorted(
        (
            (after[k] - before.get(k, 0), k[4:])
            for k in after
            if k.startswith("cpu.") and "MainThread" not in k
        ),
        reverse=True,
    )
    moved = {
        k: (after[k] - before.get(k, 0)) / max(n, 1)
        for k in after
        if after[k] != before.get(k, 0) and not k.startswith(("cpu.", "threads"))
    }
    line = ", ".join(f"{k} {v:.0f}" for k, v in moved.items()) or "nothing moved"
    busiest = ", ".join(f"{name} {ticks}" for ticks, name in cpu[:3] if ticks)
    return f"{line}; {after.get('threads', 0)} threads; busiest (ticks): {busiest or 'none'}"


TRACE: list[tuple[str, float, float]] | None = None  # (what, start, end) with --trace


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, list[int]]:
    if TRACE is not None:
        TRACE.clear()
    started = time.perf_counter()
    out = llm.generate([prompt], FIRST, use_tqdm=False)[0]
    took = time.perf_counter() - started
    if TRACE:
        steps = ", ".join(f"{w} {(a - started) * 1e3:.1f}-{(b - started) * 1e3:.1f}" for w, a, b in TRACE)
        print(f"    timeline ms: {steps}", file=sys.stderr, flush=True)
    return took, out.outputs[0].token_ids


def install_trace() -> None:
    """Time the store lookup, the worker's transfers, its launches and finishes (--trace)."""
    global TRACE
    TRACE = []
    from scheduler_svc.mesh import Mesh
    from worker_svc.kv_tiers import WorkerKVTiers
    from worker_svc.runner import ModelRunner

    def timed(cls, name: str, label: str) -> None:
        fn = getattr(cls, name)
        if asyncio.iscoroutinefunction(fn):

            async def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return await fn(*a, **kw)
                finally:
                    TRACE.append((label, t0, time.perf_counter()))  # type: ignore[union-attr]
        else:

            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    TRACE.append((label, t0, time.perf_counter()))  # type: ignore[union-attr]

        setattr(cls, name, wrapper)

    import gc

    started: dict[int, float] = {}

    def collected(phase: str, info: dict) -> None:
        gen = info.get("generation", 0)
        if phase == "start":
            started[gen] = time.perf_counter()
        elif gen >= 1 and gen in started:
            TRACE.append((f"gc{gen}", started.pop(gen), time.perf_counter()))  # type: ignore[union-attr]

    gc.callbacks.append(collected)
    timed(Mesh, "_lookup", "lookup")
    timed(WorkerKVTiers, "apply", "transfers")
    timed(WorkerKVTiers, "_save_and_put", "saves+puts")
    timed(WorkerKVTiers, "_load_from_store", "store-load")
    timed(WorkerKVTiers, "_queue_put", "queue-put")
    timed(ModelRunner, "launch", "launch")
    timed(ModelRunner, "finish", "finish")


def start_kvstore(stack: ExitStack, memory_bytes: int, redis_url: str = "", *extra: str) -> str:
    port = free_port()
    cmd = [sys.executable, "-m", "llmesh.cli", "kvstore", "--port", str(port)]
    cmd += ["--memory-bytes", str(memory_bytes), *extra]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(lambda: (proc.terminate(), proc.wait(10)))
    from kvstore_svc.client import KVStoreClient

    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with KVStoreClient(address) as client:
                client.stats(timeout_s=1.0)
            return address
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the kvstore service did not start") from None
            time.sleep(0.2)


def start_redis(stack: ExitStack) -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is missing (`make setup` installs it)")
    port = free_port()
    workdir = stack.enter_context(tempfile.TemporaryDirectory())
    password = secrets.token_urlsafe(16)  # the store refuses an anonymous Redis
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--dir", workdir, "--requirepass", password],
        stdout=subprocess.DEVNULL,
    )
    stack.callback(lambda: (proc.terminate(), proc.wait(10)))
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, password=password)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return f"redis://:{password}@127.0.0.1:{port}/0"
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def skip_mac_checks(tiers) -> None:
    """Load chunks without verifying their MACs: the benchmark's baseline for what the check costs
    (the product has no such switch: the store is untrusted storage)."""
    tiers._verified_prefix = lambda keys, headers, staged: len(keys)
    tiers._verified = lambda key, header, digest: True


def document_rows(args, engine_kw: dict, vocab: int, stack: ExitStack) -> list[tuple]:
    """TTFT of each path on fresh documents; rows of (path, TTFTs, GB/s of the load, ok, tokens loaded)."""
    rng = random.Random(args.seed)
    docs = [random_tokens(rng, args.prefix, vocab) for _ in range(args.docs)]
    questions = [random_tokens(rng, args.suffix, vocab) for _ in range(args.docs)]
    prompts = [d + q for d, q in zip(docs, questions, strict=True)]
    # Documents each asker loads before it is timed (its load predictor measures its path).
    warm_docs = [random_tokens(rng, args.prefix, vocab) for _ in range(args.warm_loads)]
    warm_asks = [d + random_tokens(rng, args.suffix, vocab) for d in warm_docs]
    kw = dict(engine_kw, kv_chunk_tokens=args.chunk_tokens)

    cold = LLM(enable_prefix_caching=False, **engine_kw)
    # Warm-ups of the documents' shape (computed): a worker that has served before, not a
    # first request paying for kernels' first launches at a long context (~0.3 s on an H100).
    warm_up = random_tokens(rng, args.prefix + args.suffix, vocab)
    ttft(cold, warm_up)
    reference = [ttft(cold, p) for p in prompts]
    first = [t for t, _ in reference]
    rows = [("recompute", first, 0.0, True, 0, first)]
    expected = [toks for _, toks in reference]
    paired = cold if args.paired else None  # kept: timed beside every row (two engines fit an H100)
    if paired is None:
        del cold
        release()

    def measure(name: str, asker: LLM, before=None) -> None:
        times, base, same = [], [], True
        counters = asker.engine.runner.kv_tiers.counters
        loaded0 = _loaded_tokens(asker)
        b0 = counters.host_loaded_bytes + counters.store_loaded_bytes
        s0 = counters.host_load_seconds + counters.store_load_seconds
        counted = _process_counters()
        for prompt, want in zip(prompts, expected, strict=True):
            if before is not None:
                before()
            if paired is not None:  # the same prompt recomputed just before (its engine idles after)
                base.append(ttft(paired, prompt)[0])
            t, got = ttft(asker, prompt)
            print(f"  {name}: TTFT {t * 1e3:.1f} ms", file=sys.stderr, flush=True)
            times.append(t)
            same &= got == want
        line = _counter_line(counted, _process_counters(), len(prompts))
        print(f"  {name}: per request (both engines): {line}", file=sys.stderr, flush=True)
        counters = asker.engine.runner.kv_tiers.counters  # now with the copy times of the last loads
        moved = counters.host_loaded_bytes + counters.store_loaded_bytes - b0
        secs = counters.host_load_seconds + counters.store_load_seconds - s0
        loaded = (_loaded_tokens(asker) - loaded0) // len(prompts)
        rows.append((name, times, moved / secs / 1e9 if secs else 0.0, same, loaded, base or first))

    def plain_row(name: str) -> None:
        plain = LLM(**kw)
        ttft(plain, warm_up)
        measure(name, plain)
        plain.engine.close()
        del plain
        release()

    if paired is not None:  # the store rows' engine, no store: what prefix caching alone costs
        plain_row("no store (prefix caching on)")

    # Worker CPU tier: a GPU cache of about one request, so each document is evicted by the next.
    if not args.skip_host_tier:
        blocks = -(-(args.prefix + args.suffix + 16) // 16) + 4
        host = LLM(**dict(engine_kw, num_kv_blocks=blocks, kv_offload_bytes=args.host_bytes))
        for d in docs:
            ttft(host, d)  # computes and saves every document; each evicts the one before
        flood = random_tokens(rng, args.prefix, vocab)
        measure("worker CPU tier", host, before=lambda h=host: ttft(h, flood))  # flood evicts first
        del host
        release()

    if args.skip_stores:
        return _without(paired, rows)
    # (row, the store, how the engine reaches a service (streamed over gRPC, through shared memory,
    # over the bulk path) and whether the predictor is on, whether the asker verifies the entries'
    # MACs: off only to measure what they cost)
    wanted = set(args.stores.split(","))
    off, on = {"kv_store_shared_memory": "off"}, {"kv_store_shared_memory": "on"}
    bulk = {"kv_store_transfer": "bulk"}
    no_predictor = {"kv_load_predictor": False}
    in_process = lambda: open_kv_store(f"memory:{args.store_bytes}")  # noqa: E731
    stores = []
    if "process" in wanted:
        stores.append(("store (in process)", in_process, off, True))
    grpc_store = lambda: start_kvstore(stack, args.store_bytes)  # noqa: E731
    if "grpc" in wanted:
        stores.append(("store (memory, gRPC)", grpc_store, off, True))
        if args.predictor_off_too:
            stores.append(("store (memory, gRPC), predictor off", grpc_store, {**off, **no_predictor}, True))
    if "segments" in wanted:
        segments = lambda: start_kvstore(stack, args.store_bytes, "", "--no-memory-arena")  # noqa: E731
        stores.append(("store (memory, shared memory segments)", segments, on, True))
    arena_store = lambda: start_kvstore(stack, args.store_bytes)  # noqa: E731
    arena = "store (memory, in place: shared arena)"
    if "inplace" in wanted:
        if args.mac_off_too:  # the same path without verification, either side of the verified one
            stores.append((arena + ", MACs off", arena_store, on, False))
        stores.append((arena, arena_store, on, True))
        if args.predictor_off_too:
            stores.append((arena + ", predictor off", arena_store, {**on, **no_predictor}, True))
        if args.mac_off_too:
            stores.append((arena + ", MACs off (again)", arena_store, on, False))
    if "redis" in wanted and not args.no_redis:
        redis_store = lambda: start_kvstore(stack, 0, start_redis(stack))  # noqa: E731
        stores.append(("store (redis, gRPC)", redis_store, off, True))
    if "bulk" in wanted:
        over_bulk = "store over bulk (another process, no shared memory)"
        stores.append((over_bulk, arena_store, bulk, True))
        if args.predictor_off_too:
            stores.append((over_bulk + ", predictor off", arena_store, {**bulk, **no_predictor}, True))
    runs = [(v, row) for v in args.variants.split(",") for row in stores]
    for variant_name, (name, make, path, verify) in runs:
        with variant(variant_name) as suffix:
            _store_row(
                args, kw, name + suffix, make, path, verify, warm_docs, docs, warm_up, warm_asks, measure
            )
    if paired is not None and args.variants != "base":
        # The control for the process drifting (issue 32: on one H100 host the no-store engine's
        # eager launch wandered from 18 to 25 ms against the paired recompute's within a row): the
        # same no-store engine again, after every store row.
        plain_row("no store (prefix caching on), again after the store rows")
    return _without(paired, rows)


def _store_row(args, kw, name, make, path, verify, warm_docs, docs, warm_up, warm_asks, measure) -> None:
    """One store row: a writer puts the documents, an asker is timed on them."""
    store = make()
    path_kw = dict(kw, kv_store_segment_bytes=args.segment_bytes, **path)
    # The writer's puts take shared memory where the store is on this host (the bulk path
    # serves gets only): its path is not what is measured.
    writer_kw = {k: v for k, v in path_kw.items() if k != "kv_store_transfer"}
    writer = LLM(kv_store=store, **writer_kw)
    for d in warm_docs + docs:  # the timed documents last: the most recent, never evicted first
        ttft(writer, d)
        # Each document's puts sent before the next is computed: 7 documents of 1 GiB (8k
        # tokens of an 8B model) in a row filled the put staging faster than the sender drained
        # it, its later chunks were dropped, and the store held ~6 leading chunks of each.
        writer.engine.flush_kv()
    c = writer.engine.runner.kv_tiers.counters  # a store row can load only what was put
    print(
        f"  {name}: writer put {c.store_put_chunks} chunks, {c.store_put_dropped} dropped, "
        f"{c.store_put_failed} failed",
        file=sys.stderr,
        flush=True,
    )
    writer.engine.close()
    del writer
    release()
    asker = LLM(kv_store=store, **path_kw)
    if not verify:
        skip_mac_checks(asker.engine.runner.kv_tiers)
    ttft(asker, warm_up)  # connects; a miss (computed, and put like any prompt)
    asker.engine.flush_kv()  # its puts are done before the loads are timed
    # Its store client has mapped and page-locked the arena or segments (done once, in the
    # background, when a worker starts: ~1 s for a 4 GiB arena on an H100 host).
    asker.engine.runner.kv_tiers.wait_prepared()
    for ask in warm_asks:  # loads (probes, then as predicted) that measure the path
        ttft(asker, ask)
    # Each ask starts with the earlier asks' puts sent (a computed 8k prompt puts 1 GiB, whose
    # sender thread would otherwise share the next ask's GIL: the recompute row has no store).
    measure(name, asker, before=asker.engine.flush_kv)
    asker.engine.close()
    del asker
    release()


def _without(engine: LLM | None, rows: list[tuple]) -> list[tuple]:
    """Close the paired recompute engine (if any) before the next workload's engines start."""
    if engine is not None:
        engine.engine.close()
        del engine
        release()
    return rows


def mesh_rows(args, model: str, vocab: int) -> list[tuple]:
    """The documents through two meshes alive side by side: one with a KV store (its worker on the
    bulk path), one without; rows as document_rows' (the store row's tokens loaded from the
    scheduler's stats)."""
    from services.launcher import start_mesh

    rng = random.Random(args.seed)
    docs = [random_tokens(rng, args.prefix, vocab) for _ in range(args.docs)]
    prompts = [d + random_tokens(rng, args.suffix, vocab) for d in docs]
    warm_docs = [random_tokens(rng, args.prefix, vocab) for _ in range(args.warm_loads)]
    warm_asks = [d + random_tokens(rng, args.suffix, vocab) for d in warm_docs]
    max_len = args.prefix + args.suffix + 64
    # A GPU cache of about three prompts: each document is evicted by those written and asked
    # after it, so its ask finds it in the store only (as on another worker).
    blocks = 3 * -(-max_len // 16)
    worker = ["--load-format", "dummy", "--device", args.device, "--max-model-len", str(max_len)]
    worker += ["--num-kv-blocks", str(blocks), "--kv-chunk-tokens", str(args.chunk_tokens)]
    worker += ["--enforce-eager"] if args.enforce_eager else []
    sched = ["--no-tokenizer", "--max-model-len", str(max_len)]
    with ExitStack() as stack:
        logs = stack.enter_context(tempfile.TemporaryDirectory())
        os.makedirs(logs + "/p"), os.makedirs(logs + "/s")
        plain = stack.enter_context(
            start_mesh(1, model=model, worker_args=worker, scheduler_args=sched, log_dir=logs + "/p")
        )
        stored = stack.enter_context(
            start_mesh(
                1,
                model=model,
                worker_args=[*worker, "--kv-store-transfer", "bulk"],
                scheduler_args=sched,
                kvstore=True,
                kvstore_args=["--memory-bytes", str(args.store_bytes)],
                log_dir=logs + "/s",
            )
        )
        warm_up = [random_tokens(rng, args.prefix + args.suffix, vocab) for _ in range(2)]
        return asyncio.run(_mesh_ttfts(plain, stored, warm_up, warm_docs + docs, warm_asks, prompts))


async def _mesh_ttfts(plain, stored, warm_up, written, warm_asks, prompts) -> list[tuple]:
    import grpc

    from llmesh.v1 import generation_pb2 as g
    from llmesh.v1 import generation_pb2_grpc as gg
    from services.grpc_server import channel_options

    async def first(stub, prompt: list[int]) -> tuple[float, list[int]]:
        req = g.GenerateRequest(
            prompt_token_ids=g.TokenIds(ids=prompt),
            sampling_params=g.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        )
        started, took, tokens = time.perf_counter(), 0.0, []
        async for resp in stub.Generate(req):
            if resp.token_ids and not tokens:
                took = time.perf_counter() - started
            tokens.extend(resp.token_ids)
        return took, tokens

    p_chan = grpc.aio.insecure_channel(plain.scheduler.address, options=channel_options())
    s_chan = grpc.aio.insecure_channel(stored.scheduler.address, options=channel_options())
    async with p_chan, s_chan:
        p_stub, s_stub = gg.SchedulerStub(p_chan), gg.SchedulerStub(s_chan)
        for prompt in warm_up:  # first launches, both meshes: workers that have served before
            await first(p_stub, prompt)
            await first(s_stub, prompt)
        for doc in written:  # computed and put; its sender is done well before the asks
            await first(s_stub, doc)
        await asyncio.sleep(2.0)
        for ask in warm_asks:  # loads (probes, then as predicted) that measure the path
            await first(s_stub, ask)
        loaded0 = _mesh_loaded(stored)
        base, times, same = [], [], True
        for prompt in prompts:
            await asyncio.sleep(0.2)  # the last ask's peek and puts are over
            b, want = await first(p_stub, prompt)
            t, got = await first(s_stub, prompt)
            print(f"  mesh: TTFT {t * 1e3:.1f} ms (no store {b * 1e3:.1f})", file=sys.stderr, flush=True)
            base.append(b)
            times.append(t)
            same &= got == want
        loaded = (_mesh_loaded(stored) - loaded0) // len(prompts)
    return [
        ("mesh, no store", base, 0.0, True, 0, base),
        ("mesh, store over bulk (another process, no shared memory)", times, 0.0, same, loaded, base),
    ]


def _mesh_loaded(mesh) -> int:
    """Prompt tokens the mesh's workers have loaded from the store so far (the scheduler's stats)."""
    from benchmarks.disaggregation import scheduler_stats

    return sum(w.store_hit_tokens for w in scheduler_stats(mesh.scheduler.address, mesh.security).workers)


def _loaded_tokens(llm: LLM) -> int:
    """Prompt tokens the engine has loaded from its tiers so far (host and store)."""
    w = next(iter(llm.engine.mesh.stats()["workers"].values()))
    return w["host_hit_tokens"] + w["store_hit_tokens"]


def throughput(llm: LLM, batches: list[list[list[int]]], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs, tokens = [], 0
    started = time.perf_counter()
    for batch in batches:
        got = llm.generate(batch, params, use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
        tokens += sum(len(o.outputs[0].token_ids) for o in got)
    return tokens / (time.perf_counter() - started), outs


def chat_rows(args, engine_kw: dict, vocab: int, stack: ExitStack) -> list[tuple]:
    """Multi-round chat over two engines in turn; random prompts with the store on and off.

    The store is a service on loopback reached through shared memory (a deployment's path; its
    own process), or with `--throughput-store memory` the store's core inside the engine's
    process (whose puts then share the engine's GIL). Each "on" run gets a fresh, empty store.
    """

    def fresh_store():
        if args.throughput_store == "memory":
            return open_kv_store(f"memory:{args.store_bytes}")
        return start_kvstore(stack, args.store_bytes)

    rng = random.Random(args.seed + 1)
    system = random_tokens(rng, args.chat_system, vocab)
    histories = [list(system) for _ in range(args.chat_users)]
    rounds = []
    for _ in range(args.chat_rounds):
        for h in histories:
            h.extend(random_tokens(rng, args.chat_turn, vocab))
        rounds.append([list(h) for h in histories])
        for h in histories:
            h.extend(random_tokens(rng, args.chat_answer, vocab))  # the "answer" the next round sees
    kw = dict(engine_kw, kv_chunk_tokens=args.chunk_tokens, kv_store_shared_memory="on")
    if args.throughput_store == "memory":
        kw.pop("kv_store_shared_memory")
    rows = []

    def two_engines(store) -> tuple[float, list]:
        a = LLM(kv_store=store, **kw) if store else LLM(**engine_kw)
        b = LLM(kv_store=store, **kw) if store else LLM(**engine_kw)
        for llm in (a, b):
            llm.engine.runner.kv_tiers.wait_prepared()
        params = SamplingParams(max_tokens=args.chat_answer, temperature=0.0, ignore_eos=True)
        tokens, outs = 0, []
        started = time.perf_counter()
        for i, batch in enumerate(rounds):
            llm = (a, b)[i % 2]
            got = llm.generate(batch, params, use_tqdm=False)
            outs.append([o.outputs[0].token_ids for o in got])
            tokens += sum(len(o.outputs[0].token_ids) for o in got)
            llm.engine.flush_kv()
        rate = tokens / (time.perf_counter() - started)
        for llm in (a, b):  # two 8B engines at a time fit an H100; four did not
            llm.engine.close()
        del a, b, llm
        release()
        return rate, outs

    off, ref = two_engines(None)
    on, got = two_engines(fresh_store())
    rows.append(("multi-round chat, 2 engines in turn", off, on, got == ref))

    randoms = [
        [random_tokens(rng, rng.randrange(args.prefix // 4, args.prefix // 2), vocab) for _ in range(8)]
        for _ in range(args.random_batches)
    ]
    # Off and on alternate (twice each): on a shared 2-core machine one run of each differs by
    # more than the effect measured.
    rates: dict[bool, list[float]] = {False: [], True: []}
    outs: dict[bool, list] = {}
    for store_on in (False, True, False, True):
        store = fresh_store() if store_on else None
        llm = LLM(kv_store=store, **kw) if store_on else LLM(**engine_kw)
        throughput(llm, [[random_tokens(rng, 64, vocab)]], 4)  # warm-up
        # A worker that has served before: its store client has mapped (and on a GPU page-locked)
        # the store's arena and segments, which a new worker does once, in the background.
        llm.engine.runner.kv_tiers.wait_prepared()
        rate, outs[store_on] = throughput(llm, randoms, args.random_output)
        rates[store_on].append(rate)
        llm.engine.close()
        del llm
        release()
    off, on = (sum(rates[k]) / len(rates[k]) for k in (False, True))
    rows.append(("random prompts (nothing reused), mean of 2", off, on, outs[True] == outs[False]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default=None,
        help="a model folder, or a shape of benchmarks/gpu.py (llama-3.1-8b, qwen2.5-0.5b) with dummy "
        "weights; default: the embedded SmolLM2-135M-Instruct",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--prefix", type=int, default=2048, help="document tokens")
    ap.add_argument("--suffix", type=int, default=32, help="question tokens")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--host-bytes", type=int, default=2 << 30)
    ap.add_argument("--store-bytes", type=int, default=4 << 30)
    ap.add_argument("--segment-bytes", type=int, default=128 << 20, help="each shared memory segment")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument(
        "--mac-off-too",
        action="store_true",
        help="also time the in-place store path with MAC verification off, before and after the verified one",
    )
    ap.add_argument("--chat-users", type=int, default=4)
    ap.add_argument("--chat-rounds", type=int, default=4)
    ap.add_argument("--chat-system", type=int, default=512)
    ap.add_argument("--chat-turn", type=int, default=64)
    ap.add_argument("--chat-answer", type=int, default=32)
    ap.add_argument("--random-batches", type=int, default=3)
    ap.add_argument("--random-output", type=int, default=32)
    ap.add_argument("--skip-chat", action="store_true")
    ap.add_argument(
        "--throughput-store",
        choices=["service", "memory"],
        default="service",
        help="the store of the throughput rows: a service on loopback (shared memory) or in process",
    )
    ap.add_argument("--trace", action="store_true", help="print each timed request's timeline (stderr)")
    ap.add_argument("--skip-documents", action="store_true")
    ap.add_argument("--skip-stores", action="store_true", help="documents: recompute and the CPU tier only")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster engine starts)")
    ap.add_argument("--skip-host-tier", action="store_true", help="documents: no worker CPU tier row")
    ap.add_argument(
        "--stores",
        default="process,grpc,segments,inplace,redis,bulk",
        help="the store rows to run (comma-separated: process, grpc, segments, inplace, redis, bulk)",
    )
    ap.add_argument(
        "--predictor-off-too",
        action="store_true",
        help="also the gRPC, in-place and bulk rows with the load predictor off",
    )
    ap.add_argument(
        "--warm-loads", type=int, default=5, help="documents each store asker loads before it is timed"
    )
    ap.add_argument(
        "--mesh",
        action="store_true",
        help="also the documents through two meshes of processes (with a store over bulk, without one)",
    )
    ap.add_argument("--mesh-only", action="store_true", help="only the mesh rows (--mesh)")
    ap.add_argument(
        "--paired",
        action="store_true",
        help="time the recompute engine on each prompt right before every row's engine (kept alive), "
        "and a row of the store rows' engine without a store",
    )
    ap.add_argument(
        "--variants",
        default="base",
        help="the store and mesh rows under each of these diagnostic variants (comma-separated: "
        + ", ".join(VARIANTS)
        + "; issue 32)",
    )
    ap.add_argument("--num-kv-blocks", type=int, default=0, help="GPU cache blocks (0 = from memory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="one short document, a short chat (make test)")
    args = ap.parse_args()
    if args.smoke:
        args.prefix, args.suffix, args.docs, args.chunk_tokens, args.random_output = 64, 8, 1, 32, 4
        args.host_bytes, args.store_bytes, args.segment_bytes = 64 << 20, 64 << 20, 8 << 20
        args.chat_users, args.chat_rounds, args.chat_system, args.chat_turn, args.chat_answer = 2, 2, 32, 8, 4
        # `--smoke --skip-chat` (make test) leaves out the chat rows' 12 engines (~7 s on 2 cores).
        args.random_batches = 1
        args.warm_loads = 1
        if args.model is None:  # dummy weights of a tiny shape: ~14 engines start in seconds on a CPU
            args.model, args.load_format = "llama-tiny", "dummy"
            SHAPES["llama-tiny"] = SMOKE_SHAPES["llama-tiny"]
    if args.model in SMOKE_SHAPES:  # a tiny shape outside --smoke: fast prefills, as a store's worst case
        SHAPES[args.model] = SMOKE_SHAPES[args.model]
    if args.trace:
        install_trace()

    engine_kw = dict(device=args.device, load_format=args.load_format, max_model_len=args.prefix + 1024)
    if args.num_kv_blocks:
        engine_kw["num_kv_blocks"] = args.num_kv_blocks
    if args.enforce_eager:
        engine_kw["enforce_eager"] = True
    if args.model in SHAPES:
        engine_kw["model"] = write_config(tempfile.mkdtemp(), args.model, SHAPES[args.model])
        engine_kw["load_format"] = "dummy"
    elif args.model:
        engine_kw["model"] = args.model
    probe = LLM(**dict(engine_kw, num_kv_blocks=8))
    vocab = probe.engine.info.vocab_size
    device = str(probe.engine.runner.device)
    kv_per_token = probe.engine.runner.kv_tiers.spec.bytes_per_block // probe.engine.info.block_size
    del probe
    release()
    # Room in the store for every document an asker reads (timed and warm-up), its warm-up prompt
    # and a margin: 8k-token documents of an 8B model are 1 GiB each, and a store that evicted
    # the timed ones measured misses (computed) instead of loads.
    needed = (args.docs + args.warm_loads + 2) * (args.prefix + args.suffix) * kv_per_token * 5 // 4
    if args.store_bytes < needed:
        print(f"store bytes {args.store_bytes} -> {needed} (every document fits)", file=sys.stderr)
        args.store_bytes = needed

    with ExitStack() as stack:
        skip = args.skip_documents or args.mesh_only
        rows = [] if skip else document_rows(args, engine_kw, vocab, stack)
    if rows:
        print_documents(args, rows, kv_per_token, device)
    if args.mesh or args.mesh_only:
        for variant_name in args.variants.split(","):
            with variant(variant_name) as suffix:
                mesh = mesh_rows(args, engine_kw.get("model"), vocab)
            mesh = [(row[0] + suffix, *row[1:]) for row in mesh]
            print_documents(args, mesh, kv_per_token, device, paired=True)
    if args.skip_chat:
        return
    with ExitStack() as stack:
        chat = chat_rows(args, engine_kw, vocab, stack)
    print("\n| workload | out tok/s store off | out tok/s store on | on / off | same tokens |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, off, on, same in chat:
        print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.1%} | {'yes' if same else 'NO'} |")
    if args.smoke and not all([*(r[3] for r in rows), *(r[-1] for r in chat)]):
        sys.exit("smoke: a path's tokens differ from recompute's")


def print_documents(args, rows: list[tuple], kv_per_token: int, device: str, paired: bool = False) -> None:
    """Mean and median TTFT per path: a single eager launch on a busy host can take 2-3x its
    usual time, and a mean of a few documents moved by 10 ms for it (issue 32's 256-token rows)."""
    base, base_median = statistics.mean(rows[0][1]), statistics.median(rows[0][1])
    doc_mb = args.prefix * kv_per_token / 1e6
    print(
        f"\nlong shared document: {args.prefix}-token prefix ({doc_mb:.0f} MB of KV) + {args.suffix}-token "
        f"question, {args.docs} documents, device {device}"
    )
    paired = paired or args.paired
    extra = " paired recompute ms median | vs paired (mean) | vs paired (median) |" if paired else ""
    print(
        "| path | TTFT ms mean | vs recompute | TTFT ms median | vs recompute (median) | load GB/s "
        f"| tokens loaded | same tokens |{extra}"
    )
    aligns = "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    print(aligns + (" ---: | ---: | ---: |" if paired else ""))
    for name, times, gbs, same, loaded, beside in rows:
        t, m = statistics.mean(times), statistics.median(times)
        cells = ""
        if paired:  # against the recompute engine timed on the same prompts just before
            bt, bm = statistics.mean(beside), statistics.median(beside)
            cells = f" {bm * 1e3:.1f} | {bt / t:.3f}x | {bm / m:.3f}x |"
        print(
            f"| {name} | {t * 1e3:.1f} | {base / t:.2f}x | {m * 1e3:.1f} | {base_median / m:.2f}x "
            f"| {gbs:.2f} | {loaded} | {'yes' if same else 'NO'} |{cells}"
        )


if __name__ == "__main__":
    main()
