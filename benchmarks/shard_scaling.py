"""Scale-out across scheduler shards: one shard alone against N shards behind the router tier.

    .venv/bin/python benchmarks/shard_scaling.py [--shards 4] [--workers-per-shard 2]
        [--streams-per-shard 256] [--requests-per-shard 2048] [--prompt-len 128] [--output-len 128]
        [--stream-interval 1] [--api-server-count 6] [--client-procs-per-shard 8]
        [--router-procs 2N] [--router-reuse-port] [--router-policy index] [--one-via-router]
        [--cpus-per-shard C] [--cpu-order 0,8,1,9,...] [--rows one,relay,direct,split,isolated]
        [--connections-per-client 2]
    .venv/bin/python benchmarks/shard_scaling.py --smoke    # seconds, 2-core machine (make test)

Issue 30's must-show "8 null workers over 4 shards >= 3.5x one shard", in one run and one table.
Every shard is a real scheduler service (`--api-server-count` API processes in front of its core)
with `--workers-per-shard` null workers (`null_worker.py`: every plan answered at once), driven
by streaming gRPC clients in several processes (prompt 128, output 128, stream interval 1):

  * `1 shard`: the clients talk to shard 0 directly (scheduler_bound.py's setting), with
    `--streams-per-shard` streams and `--client-procs-per-shard` client processes;
  * `1 shard + router` (`--one-via-router`): the same, through the router tier (its cost per token);
  * `N shards + router`: N shards behind `--router-procs` router processes (`llmesh router`),
    N times the streams, requests and client processes;
  * `N shards + router (direct)`: the same, but the router only picks: each request asks it
    (`ShardPicker.Route`) and streams from the chosen shard itself (gateway/shard_routing.py, what
    the gateway does with --direct-to-shards). `--rows` picks the rows (default one,relay,direct);
  * `N shards, no router` (`split`): client process i streams straight to shard i mod N, no Route,
    the same streams per shard: what the N shards carry with routing free and the split even;
  * `N x 1 shard, own cores` (`isolated`, needs `--cpus-per-shard C`): the same, but each shard
    and its client processes pinned to C cores of their own: N copies of the 1-shard row side by
    side, nothing shared but the host. Its ratio to the 1-shard row is the most N shards can give
    on this host, whatever the router does.

In the relay rows the router relays every response message, so at stream interval 1 it carries
each token of the cluster once more: one process would be the ceiling, so the router tier is
several processes, each with every shard (each subscribes to every shard's KV events and load).
By default each router process has its own port and client process i talks to router i mod R;
`--router-reuse-port` puts them on one port (`llmesh router --reuse-port`, SO_REUSEPORT) and
lets the kernel spread the client connections (one per client process: an uneven spread with few).

CPU budget: by default every row runs on the whole host (the table's `procs` column counts the
processes of the row, `cpus` the cores they share). `--cpus-per-shard C` pins each row's
processes (shards, API processes, workers, routers, clients) to its first C x shards CPUs, a
core's hyperthreads side by side (`cpu_order`: a slice of the host's cores, not of its
threads): the 1-shard row gets C CPUs, the N-shard row N x C: scale-out with the resources, not a smaller
share of a fixed host. Shards not in a row are started but idle (no request reaches them).

Each client process keeps `--connections-per-client` TCP connections per shard (or router) and
spreads its streams over them: a shard's API processes share its port, and the kernel hands
each connection, not each stream, to one of them, by a hash. The 1-shard, split, isolated and
direct rows go through gateway/shard_routing.py's ShardChannels, which learns which API process
each connection reached and keeps the streams even over the processes.

Reported per row: out tok/s, failed (errors other than RESOURCE_EXHAUSTED) and refused, TTFT
and ITL, and the ratio of the N-shard row to the 1-shard row; and where the CPU went (from
/proc, over the row): `rtr busy` the busiest router process (100 %: one core all the time, that
process is the ceiling), `rtr us/t` the router tier's CPU per output token, `core busy` the
busiest shard core (its planning loop is single-threaded), `row us/t` every process of the row
(shards, API processes, workers, routers, clients) per output token: a host of C cores carries
at most C / `row us/t` tokens a second, whatever the sharding; `API busy` / `cli busy` the
busiest and idlest API process and client process; `Route p50` the direct row's Route call as
its caller waits for it, the opening burst (each stream's first request) left out; and a second
table of the row's CPU per output token by role (shard cores, API processes, workers, routers,
clients) with the cores the row used. Exit 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from null_worker import VOCAB  # noqa: E402
from serving import RequestStats, grpc_request, make_prompts, report  # noqa: E402

from services.launcher import free_port, grpc_serving, wait_until  # noqa: E402

HOST = "127.0.0.1"
ROWS = {"one", "one-relay", "relay", "direct", "split", "isolated"}
HERE = os.path.dirname(os.path.abspath(__file__))


# ----- CPU pinning: a row's processes (and every thread of each) share its cores -----
def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (a scheduler's API processes)."""
    out = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for child in f.read().split():
                    out += _tree(int(child))
    except OSError:
        pass
    return out


def pin(pids: list[int], cpus: set[int] | None) -> None:
    """Every thread of `pids` and their children onto `cpus` (threads started later inherit it)."""
    if cpus is None:
        return
    for pid in {p for root in pids for p in _tree(root)}:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # the thread ended meanwhile
                pass


def _cpu_list(text: str) -> list[int]:
    """`0-2,8` -> [0, 1, 2, 8] (the kernel's CPU list format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


# Set by --cpu-order: the order host_scaling.py --pairs found, where sysfs hides the siblings.
_CPU_ORDER: list[int] = []


def cpu_order() -> list[int]:
    """This process's CPUs with each core's hyperthreads side by side: the first k of them are
    k / threads-per-core whole cores, whatever the host's numbering (siblings are often i and
    i + cores). A row's slice of the host is then a slice of its cores, as a pod's would be.
    `--cpu-order` gives the order instead (a KVM guest's sysfs may say "1 thread per core" of
    vCPUs that are siblings on the host: host_scaling.py --pairs finds them by timing)."""
    allowed = sorted(os.sched_getaffinity(0))
    if _CPU_ORDER:
        return [c for c in _CPU_ORDER if c in allowed]
    order: list[int] = []
    for cpu in allowed:
        if cpu in order:
            continue
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                siblings = _cpu_list(f.read())
        except (OSError, ValueError):
            siblings = [cpu]
        order += [c for c in sorted(set(siblings) | {cpu}) if c in allowed and c not in order]
    return order


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (every thread), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy(pids: list[int], before: dict[int, float], wall: float) -> list[float]:
    """Each process's share of one core over the last `wall` seconds (1.0: a core all the time)."""
    return [(cpu_seconds(p) - before.get(p, 0.0)) / wall for p in pids]


def _client_process(
    target, prompts, output_len, concurrency, timeout, start_at, cpus, direct=False, connections=1
):
    """One client process (spawned): its share of streams against one address, from `start_at`;
    `direct`: the address is a router, asked for a shard per request (route, then stream).
    Answers (stats, end time, Route's seconds per request: direct only, its CPU seconds over the
    run: every thread, measured here, since which of the pool's processes runs it is the pool's
    choice)."""
    if cpus is not None:
        pin([os.getpid()], set(cpus))
    import gateway.shard_routing  # noqa: F401 - imported before the clock starts, not counted as the row's
    from llmesh.v1 import router_pb2_grpc  # noqa: F401

    time.sleep(max(0.0, start_at - time.time()))
    cpu = time.process_time()
    run = run_direct_clients if direct else run_grpc_clients
    results, end, routes = asyncio.run(run(target, prompts, output_len, concurrency, timeout, connections))
    return [asdict(r) for r in results], end, routes, time.process_time() - cpu


class _Balanced:
    """What serving.grpc_request calls: Generate on `address` over `channels` (ShardChannels: the
    least busy API process of the shard, then its least busy connection), as the direct path does.
    The call is the grpc.aio call itself (no wrapper: nothing more per token)."""

    def __init__(self, channels, address: str) -> None:
        self.channels, self.address = channels, address

    def Generate(self, request, timeout: float):  # noqa: N802
        lane = self.channels.acquire(self.address)
        call = lane.generate(request, timeout=timeout, metadata=self.channels.metadata, wait_for_ready=False)
        call.add_done_callback(lambda _: self.channels.release(self.address, lane))
        return call


async def run_grpc_clients(
    target: str, prompts: list[list[int]], output_len: int, concurrency: int, timeout: float, connections: int
) -> tuple[list[RequestStats], float, list[float]]:
    """`concurrency` streams straight to `target` over `connections` connections, each request on
    the least busy API process's least busy connection (gateway/shard_routing.py's ShardChannels):
    a shard's API processes share its port and the kernel spreads connections, not streams, over
    them, by a hash."""
    from gateway.shard_routing import ShardChannels

    queue = list(reversed(prompts))
    results: list[RequestStats] = []
    channels = ShardChannels(connections=connections)
    stub = _Balanced(channels, target)

    async def loop() -> None:
        while queue:
            results.append(await grpc_request(stub, queue.pop(), output_len, timeout))

    try:
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    finally:
        await channels.close()
    return results, time.time(), []


async def run_direct_clients(
    router: str, prompts: list[list[int]], output_len: int, concurrency: int, timeout: float, connections: int
) -> tuple[list[RequestStats], float, list[float]]:
    """`concurrency` streams that ask the router (ShardPicker.Route) for a shard and stream from it
    (gateway/shard_routing.py, as the gateway with --direct-to-shards, `connections` per shard),
    over `prompts`; also each Route call's seconds."""
    from gateway.shard_routing import ShardChannels, ShardRouter
    from llmesh.v1 import router_pb2_grpc
    from services.grpc_server import open_channel

    class Stub:  # what serving.grpc_request calls
        def __init__(self, routed: ShardRouter) -> None:
            self.Generate = lambda request, timeout: routed.generate(request, timeout)  # noqa: N815

    routes: list[float] = []

    class TimedPicker:  # Route's latency as the caller sees it (queueing in both processes included)
        def __init__(self, stub: router_pb2_grpc.ShardPickerStub) -> None:
            self.stub = stub
            self.calls = 0

        async def Route(self, ask, **kw):  # noqa: N802
            # The first call of each stream is the opening burst (every stream at once): kept out,
            # so the figures say what a request waits in the steady state.
            opening = self.calls < concurrency
            self.calls += 1
            t0 = time.perf_counter()
            try:
                return await self.stub.Route(ask, **kw)
            finally:
                if not opening:
                    routes.append(time.perf_counter() - t0)

    queue = list(reversed(prompts))
    results: list[RequestStats] = []
    channel = open_channel(router)  # Route is internal: this host's mesh key (services/mesh_secret.py)
    channels = ShardChannels(connections=connections)
    picker = TimedPicker(router_pb2_grpc.ShardPickerStub(channel))
    stub = Stub(ShardRouter(picker, channels))  # type: ignore[arg-type]

    async def loop() -> None:
        while queue:
            results.append(await grpc_request(stub, queue.pop(), output_len, timeout))

    try:
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    finally:
        await channels.close()
        await channel.close()
    return results, time.time(), routes


def _warm(_: int) -> int:
    import grpc  # noqa: F401 - what a client imports, done before the first row

    from llmesh.v1 import generation_pb2_grpc  # noqa: F401

    return os.getpid()


def drive(
    pool,
    targets: list[str],
    procs: int,
    prompts,
    output_len: int,
    streams: int,
    timeout: float,
    cpus,
    direct: bool = False,
    connections: int = 1,
) -> tuple[list[RequestStats], float, list[float], list[float]]:
    """`streams` streams in `procs` client processes, process i against targets[i % len] on
    cpus[i % len(cpus)] (`cpus`: one set for all, or one per target); (stats, wall seconds, Route's
    seconds per request, each client process's CPU seconds)."""
    cpu_sets = cpus if isinstance(cpus, list) else [cpus]
    procs = max(1, min(procs, streams))
    start_at = time.time() + 1.0
    futures = [
        pool.submit(
            _client_process, targets[i % len(targets)], prompts[i::procs], output_len,
            streams // procs + (i < streams % procs), timeout, start_at,
            sorted(cpu_sets[i % len(cpu_sets)]) if cpu_sets[i % len(cpu_sets)] is not None else None,
            direct, connections,
        )
        for i in range(procs)
    ]  # fmt: skip
    parts = [f.result() for f in futures]
    results = [RequestStats(**r) for part, _, _, _ in parts for r in part]
    routes = [t for _, _, part, _ in parts for t in part]
    cpu = [c for _, _, _, c in parts]
    return results, max(end for _, end, _, _ in parts) - start_at, routes, cpu


# ----- the mesh -----
@dataclass
class Shard:
    address: str
    procs: list[subprocess.Popen]  # the scheduler (its API processes are its children), its workers


class Mesh:
    def __init__(self, args: argparse.Namespace, logs: str) -> None:
        self.args, self.logs = args, logs
        self.procs: list[subprocess.Popen] = []
        self.shards: list[Shard] = []
        self.routers: list[subprocess.Popen] = []
        self.router_addresses: list[str] = []

    def spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        with open(os.path.join(self.logs, f"{name}.log"), "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def start_shards(self, n: int) -> None:
        a = self.args
        limits = ["--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", "16384"]
        limits += ["--stream-interval", str(a.stream_interval), "--api-server-count", str(a.api_server_count)]
        for s in range(n):
            address = f"{HOST}:{free_port(HOST)}"
            procs = [self.spawn(f"shard{s}", [
                sys.executable, "-m", "scheduler_svc.service", "--host", HOST,
                "--port", address.rsplit(":", 1)[1], "--no-tokenizer", "--shard-id", f"shard{s}", *limits,
            ])]  # fmt: skip
            for w in range(a.workers_per_shard):
                procs.append(self.spawn(f"shard{s}-worker{w}", [
                    sys.executable, os.path.join(HERE, "null_worker.py"), "--host", HOST,
                    "--port", str(free_port(HOST)), "--scheduler", address,
                    "--worker-id", f"null-{s}-{w}", "--max-num-seqs", str(a.max_num_seqs),
                ]))  # fmt: skip
            self.shards.append(Shard(address, procs))
        for shard in self.shards:
            wait_until(lambda s=shard: grpc_serving(s.address), f"shard {shard.address}", self.procs, 180)
            wait_until(
                lambda s=shard: workers_in(s.address) >= a.workers_per_shard,
                f"the null workers of {shard.address}", self.procs, 180,
            )  # fmt: skip

    def start_routers(self, shards: list[Shard], procs: int) -> None:
        """The router tier of `procs` processes in front of `shards` (replacing any before)."""
        self.stop(self.routers)
        self.routers, self.router_addresses = [], []
        a = self.args
        shared_port = free_port(HOST) if a.router_reuse_port else None
        for r in range(procs):
            port = shared_port or free_port(HOST)
            cmd = [sys.executable, "-m", "router_svc.service", "--host", HOST, "--port", str(port),
                   "--shards", ",".join(s.address for s in shards), "--policy", a.router_policy,
                   "--load-interval-ms", "20", *(["--reuse-port"] if shared_port else [])]  # fmt: skip
            self.routers.append(self.spawn(f"router{len(shards)}-{r}", cmd))
            if f"{HOST}:{port}" not in self.router_addresses:
                self.router_addresses.append(f"{HOST}:{port}")
        # On a shared port each health check reaches one process (a new connection, spread by the
        # kernel): every one is SERVING (it has a ready shard) once many checks in a row say so.
        checks = 4 * procs if shared_port else 1
        for router in self.router_addresses:
            every = lambda r=router: all(grpc_serving(r) for _ in range(checks))  # noqa: E731
            wait_until(every, f"router {router}", self.procs, 180)

    def stop(self, procs: list[subprocess.Popen]) -> None:
        procs = list(procs)
        self.procs = [p for p in self.procs if p not in procs]  # an ended one is no early exit
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def shard_stats(address: str):
    from llmesh.v1 import worker_pb2, worker_pb2_grpc
    from services.grpc_server import open_sync_channel

    with open_sync_channel(address) as channel:
        return worker_pb2_grpc.RegistryStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=10)


def served(address: str) -> int:
    """Prompt tokens a shard has placed on its workers so far (its prefix-cache queries)."""
    return sum(w.prefix_queries for w in shard_stats(address).workers)


def workers_in(address: str) -> int:
    return sum(w.connected for w in shard_stats(address).workers)


def idle(shards: list[Shard]) -> bool:
    return all(shard_stats(s.address).active_requests == 0 for s in shards)


# ----- the run -----
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=4, help="shards of the scaled row")
    ap.add_argument("--workers-per-shard", type=int, default=2)
    ap.add_argument("--streams-per-shard", type=int, default=256)
    ap.add_argument("--requests-per-shard", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--stream-interval", type=int, default=1, help="every shard's --stream-interval")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="every worker's and shard's")
    ap.add_argument(
        "--api-server-count",
        type=int,
        default=6,
        help="every shard's API processes (6: one shard's best on the 16-core host, docs/benchmarks.md)",
    )
    ap.add_argument("--client-procs-per-shard", type=int, default=8, help="(8: as that best run)")
    ap.add_argument(
        "--connections-per-client",
        type=int,
        default=2,
        help="TCP connections each client process opens first per shard (gateway/shard_routing.py's "
        "default); more are opened while one of the shard's API processes is unreached, and the "
        "streams are kept even over the processes",
    )
    ap.add_argument(
        "--router-procs",
        type=int,
        default=None,
        help="router processes (default: 2 per shard of the N-shard row: at stream interval 1 a router "
        "process relays ~90 us of CPU per token on the 2-core dev machine)",
    )
    ap.add_argument(
        "--direct-router-procs",
        type=int,
        default=1,
        help="router processes of the direct row (a picker costs one call per request, not a relay "
        "per token; every process ingests every shard's KV events, so more cost more)",
    )
    ap.add_argument(
        "--router-reuse-port",
        action="store_true",
        help="the router processes share one port (SO_REUSEPORT); default: a port each, clients spread",
    )
    ap.add_argument("--router-policy", default="index", choices=["index", "load", "round-robin"])
    ap.add_argument("--one-via-router", action="store_true", help="also 1 shard through the router tier")
    ap.add_argument(
        "--rows",
        default="one,relay,direct",
        help="rows, comma-separated: one (1 shard, no router), one-relay (1 shard through the router), "
        "relay (N shards, the router relays every token), direct (N shards, the router picks: "
        "ShardPicker.Route, each client streams from the shard)",
    )
    ap.add_argument(
        "--cpus-per-shard",
        type=int,
        default=0,
        help="pin a row of n shards (and its clients, routers) to its first n x C cores (0: no pinning)",
    )
    ap.add_argument(
        "--cpu-order",
        default="",
        help="the CPUs in the order rows take them, siblings side by side (host_scaling.py --pairs "
        "prints it); default: sysfs's thread siblings",
    )
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--smoke", action="store_true", help="1 vs 2 shards, a few tiny requests (make test)")
    args = ap.parse_args(argv)
    if args.cpu_order:
        _CPU_ORDER[:] = [int(c) for c in args.cpu_order.split(",")]
    if args.smoke:
        args.shards, args.workers_per_shard, args.streams_per_shard, args.requests_per_shard = 2, 1, 4, 8
        args.prompt_len, args.output_len, args.max_num_seqs, args.api_server_count = 8, 4, 8, 0
        args.client_procs_per_shard, args.router_procs, args.router_reuse_port = 1, 2, True
        args.timeout = 60.0
    if args.router_procs is None:
        args.router_procs = 2 * args.shards
    ncpu = os.cpu_count() or 1
    if args.cpus_per_shard and args.cpus_per_shard * args.shards > ncpu:
        ap.error(f"--cpus-per-shard {args.cpus_per_shard} x {args.shards} shards > {ncpu} cores")

    # (label, shards in the row, how: "" straight to shard 0, "relay" through the router tier,
    # "direct" the router picks and each client streams from the shard)
    rows_wanted = set(args.rows.split(","))
    if args.one_via_router:
        rows_wanted.add("one-relay")
    if "isolated" in rows_wanted and not args.cpus_per_shard:
        ap.error("--rows isolated needs --cpus-per-shard")
    if rows_wanted - ROWS:
        ap.error(f"--rows: unknown {sorted(rows_wanted - ROWS)}; choose from {sorted(ROWS)}")
    many = f"{args.shards} shard{'s' if args.shards > 1 else ''} + router"
    plan = [
        (label, n, how)
        for key, label, n, how in [
            ("one", "1 shard", 1, ""),
            ("one-relay", "1 shard + router", 1, "relay"),
            ("relay", many, args.shards, "relay"),
            ("direct", f"{many} (direct)", args.shards, "direct"),
            ("split", f"{args.shards} shards, no router", args.shards, "split"),
            ("isolated", f"{args.shards} x 1 shard, own cores", args.shards, "isolated"),
        ]
        if key in rows_wanted and not (key == "one-relay" and args.shards == 1)
    ]

    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    max_clients = args.client_procs_per_shard * args.shards
    rows = []
    with (
        tempfile.TemporaryDirectory() as logs,
        ProcessPoolExecutor(max_clients, mp_context=mp.get_context("spawn")) as pool,
    ):
        # Imports done before the first row. (Not the client processes' ids: the pool starts as
        # few processes as keep up with these calls, 3 of 8 here, and a row's calls may go to
        # others; each client process measures its own CPU instead.)
        list(pool.map(_warm, range(max_clients)))
        mesh = Mesh(args, logs)
        try:
            mesh.start_shards(args.shards)
            for row_index, (label, n, how) in enumerate(plan):
                shards = mesh.shards[:n]
                cpus = set(cpu_order()[: args.cpus_per_shard * n]) if args.cpus_per_shard else None
                if how in ("relay", "direct"):
                    procs = args.direct_router_procs if how == "direct" else args.router_procs
                    mesh.start_routers(shards, procs)
                    targets = mesh.router_addresses
                    # One router's address per client process: processes spread over every address.
                    router_procs = len(mesh.routers)
                else:  # the clients straight to the shards: client process i to shard i mod n
                    mesh.stop(mesh.routers)
                    mesh.routers, targets, router_procs = [], [s.address for s in shards], 0
                client_cpus: set[int] | None | list = cpus
                if how == "isolated":  # each shard and its clients on C cores of their own
                    c = args.cpus_per_shard
                    own = [set(cpu_order()[k * c : (k + 1) * c]) for k in range(n)]
                    for shard, its in zip(shards, own, strict=True):
                        pin([p.pid for p in shard.procs], its)
                    client_cpus = own
                else:
                    pin([p.pid for s in shards for p in s.procs] + [p.pid for p in mesh.routers], cpus)
                wait_until(lambda s=shards: idle(s), "the shards to drain", mesh.procs, 120)
                streams = args.streams_per_shard * n
                # Prompts of its own per row: a row routed by the prefix index must not find the
                # previous row's prompts cached (it would follow them, not the load).
                prompts = make_prompts(args.requests_per_shard * n, args.prompt_len, VOCAB, seed=row_index)
                clients = args.client_procs_per_shard * n
                # The router processes' and the shards' cores' CPU over the row: is one the ceiling?
                watched = [p.pid for p in mesh.routers] + [s.procs[0].pid for s in shards]
                before = {p: cpu_seconds(p) for p in watched}
                # Every process of the row but the clients (they count their own): its CPU per token.
                everything = [p for s in shards for root in s.procs for p in _tree(root.pid)]
                everything += [p.pid for p in mesh.routers]
                before_all = {p: cpu_seconds(p) for p in everything}
                served_before = [served(s.address) for s in shards]
                results, wall, routes, client_cpu = drive(
                    pool, targets, clients, prompts, args.output_len, streams, args.timeout, client_cpus,
                    direct=how == "direct", connections=args.connections_per_client,
                )  # fmt: skip
                row = report(label, streams, results, wall)
                per_shard = 1 + args.api_server_count + args.workers_per_shard
                loads = busy(watched, before, wall + 1.0)  # the clients start 1 s after `before`
                row_cpu = sum(busy(everything, before_all, 1.0)) + sum(client_cpu)  # the row's CPU seconds
                # Who was busy (a process at 100 % is a ceiling): API processes, workers, clients.
                share = dict(zip(everything, busy(everything, before_all, wall + 1.0), strict=True))
                # The row's CPU per token by role: where a row's extra CPU per token goes.
                cores = [s.procs[0].pid for s in shards]
                api_pids = [p for s in shards for p in _tree(s.procs[0].pid)[1:] if p in share]
                roles = {
                    "core": cores, "api": api_pids, "workers": [p.pid for s in shards for p in s.procs[1:]],
                    "router": [p.pid for p in mesh.routers],
                }  # fmt: skip
                apis = [share[p] for s in shards for p in _tree(s.procs[0].pid)[1:] if p in share]
                workers = [share[p.pid] for s in shards for p in s.procs[1:]]
                client_load = sorted((c / wall for c in client_cpu), reverse=True)
                routes.sort()
                tokens = max(row["tok_s"] * wall, 1)
                router_load, core_load = loads[: len(mesh.routers)], loads[len(mesh.routers) :]
                row.update(
                    router_busy=max(router_load, default=0.0), core_busy=max(core_load),
                    router_us_tok=1e6 * sum(router_load) * (wall + 1.0) / tokens,
                    row_us_tok=1e6 * row_cpu / tokens,
                    shards=n, procs=n * per_shard + router_procs + min(clients, streams),
                    cpus=len(cpus) if cpus else ncpu, router_procs=router_procs,
                    api_max=max(apis, default=0.0), api_min=min(apis, default=0.0),
                    worker_max=max(workers, default=0.0), client_max=max(client_load, default=0.0),
                    client_min=min(client_load, default=0.0),
                    route_p50=routes[len(routes) // 2] * 1e3 if routes else 0.0,
                    route_p99=routes[int(len(routes) * 0.99)] * 1e3 if routes else 0.0,
                    us_by_role={
                        **{
                            role: 1e6 * sum(share[p] for p in pids) * (wall + 1.0) / tokens
                            for role, pids in roles.items()
                        },
                        "clients": 1e6 * sum(client_cpu) / tokens,
                    },
                    cores_used=row_cpu / wall,
                )  # fmt: skip
                rows.append(row)
                per = [served(s.address) - b for s, b in zip(shards, served_before, strict=True)]
                print(
                    f"{label}: {row['tok_s']:,.0f} out tok/s, {row['failed']} failed, "
                    f"{row['refused']} refused of {row['requests']}; requests per shard "
                    f"{[tokens // args.prompt_len for tokens in per]}; busy (100 %: a core): core "
                    f"{100 * row['core_busy']:.0f} %, API processes {100 * row['api_max']:.0f}-"
                    f"{100 * row['api_min']:.0f} %, workers <= {100 * row['worker_max']:.0f} %, clients "
                    f"{100 * row['client_max']:.0f}-{100 * row['client_min']:.0f} %"
                    + (
                        f"; Route p50 {row['route_p50']:.2f} ms, p99 {row['route_p99']:.2f} ms" * bool(routes)
                    ),
                    flush=True,
                )
        except BaseException:
            for name in sorted(os.listdir(logs)):  # the services' own words on why
                with open(os.path.join(logs, name), errors="replace") as f:
                    print(f"--- {name} (last lines)\n" + "".join(f.readlines()[-20:]), file=sys.stderr)
            raise
        finally:
            mesh.stop(mesh.procs)

    print()
    print(
        f"null workers, prompt {args.prompt_len}, output {args.output_len}, stream interval "
        f"{args.stream_interval}; per shard: {args.workers_per_shard} null workers, "
        f"{args.api_server_count} API processes, {args.streams_per_shard} streams, "
        f"{args.requests_per_shard} requests, {args.client_procs_per_shard} client processes of "
        f"{args.connections_per_client} connections each; "
        f"router: {args.router_policy}, "
        + ("one port (SO_REUSEPORT)" if args.router_reuse_port else "a port per process")
        + f"; host: {ncpu} cores"
    )
    print(
        f"{'row':<28}{'streams':>8}{'reqs':>7}{'failed':>7}{'refused':>8}{'out tok/s':>11}{'vs 1':>7}"
        f"{'TTFT p50':>10}{'ITL p50':>9}{'ITL p99':>9}{'routers':>8}{'rtr busy':>9}{'rtr us/t':>9}"
        f"{'core busy':>10}{'API busy':>10}{'cli busy':>10}{'Route p50':>10}{'row us/t':>9}"
        f"{'procs':>6}{'cpus':>5}"
    )
    base = rows[0]["tok_s"] if rows[0]["shards"] == 1 else 0.0
    vs = lambda r: f"{r['tok_s'] / base:>6.2f}x" if base else f"{'—':>7}"  # noqa: E731
    spread = lambda hi, lo: f"{100 * hi:.0f}-{100 * lo:.0f}%"  # noqa: E731  busiest-idlest process
    ms = lambda t: f"{t:.2f}ms" if t else ""  # noqa: E731
    for r in rows:
        print(
            f"{r['path']:<28}{r['concurrency']:>8}{r['requests']:>7}{r['failed']:>7}{r['refused']:>8}"
            f"{r['tok_s']:>11,.0f}{vs(r)}"
            f"{r['ttft_p50_ms']:>8.1f}ms{r['itl_p50_ms']:>7.2f}ms{r['itl_p99_ms']:>7.2f}ms"
            f"{r['router_procs']:>8}{100 * r['router_busy']:>8.0f}%{r['router_us_tok']:>9.1f}"
            f"{100 * r['core_busy']:>9.0f}%{spread(r['api_max'], r['api_min']):>10}"
            f"{spread(r['client_max'], r['client_min']):>10}"
            f"{ms(r['route_p50']):>10}"
            f"{r['row_us_tok']:>9.1f}{r['procs']:>6}{r['cpus']:>5}"
        )
        if r["errors"]:
            print(f"    errors: {r['errors']}")
    print("\nCPU per output token by role (us; the row's cores used = out tok/s x row us/t)")
    roles = ["core", "api", "workers", "router", "clients"]
    print(f"{'row':<28}" + "".join(f"{role:>9}" for role in roles) + f"{'row':>9}{'cores used':>12}")
    for r in rows:
        cells = "".join(f"{r['us_by_role'][role]:>9.1f}" for role in roles)
        print(f"{r['path']:<28}{cells}{r['row_us_tok']:>9.1f}{r['cores_used']:>7.1f} of {r['cpus']}")
    last = rows[-1]
    ratio = f"{last['path']} / 1 shard: {last['tok_s'] / base:.2f}x out tok/s; " if base else ""
    print(f"\n{ratio}failed {sum(r['failed'] for r in rows)} of {sum(r['requests'] for r in rows)} requests")
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
