"""Soak test: the supervised mesh under a mixed OpenAI load for a while, one worker SIGKILLed on the way.

Starts scheduler + 2 workers + gateway on loopback (CPU, the embedded SmolLM2) under the
`llmesh up` supervisor, warms up, then for --duration-s runs several concurrent clients
sending streaming and non-streaming /v1/completions and /v1/chat/completions requests.
Some streaming clients hang up mid-stream (counted as cancelled, not failed). At about a
third of the run one worker is SIGKILLed; the supervisor restarts it and it rejoins.

Prints requests ok / failed / cancelled with p50/p99 latency, every service's RSS after
warm-up and at the end, and free vs total KV blocks once the load has stopped. Exits 1
when a target is missed: no failed request, RSS growth <= --max-rss-growth-pct, every KV
block free after the load, the killed worker back.

    .venv/bin/python benchmarks/soak.py [--duration-s 600] [--clients 6]
    .venv/bin/python benchmarks/soak.py --duration-s 60        # the short form
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from services.launcher import Backoff, LocalMesh, Supervisor, start_mesh  # noqa: E402
from services.mesh_secret import ENV_KEY, new_key  # noqa: E402

SHARED_PREFIX = "You are a concise assistant. Answer in one short sentence and do not repeat the question. "
TOPICS = [
    "Why is the sky blue?",
    "Name three prime numbers.",
    "What does a compiler do?",
    "Describe the sea at night.",
    "Write a haiku about autumn.",
    "How do bees make honey?",
    "What is the capital of Japan?",
    "Explain recursion to a child.",
]
KINDS = ["completions", "completions+stream", "chat", "chat+stream"]


@dataclass
class Result:
    kind: str
    outcome: str  # ok | failed | cancelled
    started_s: float  # since the load began: places a failure relative to the kill
    latency_s: float
    error: str = ""


@dataclass
class KillReport:
    at_s: float | None = None  # since the load began
    rejoined_after_s: float | None = None  # SIGKILL -> connected again in GetStats
    restarted_pid: int | None = None


@dataclass
class Load:
    """The clients' shared settings."""

    base_url: str
    model: str
    max_tokens: tuple[int, int]
    disconnect_prob: float
    t0: float = 0.0
    results: list[Result] = field(default_factory=list)


# -- one request ----------------------------------------------------------------------


def request_body(kind: str, model: str, rng: random.Random, max_tokens: tuple[int, int]) -> dict:
    # Half share a prefix (prefix caching, routing by hit); half start apart, so that the router
    # balances them by load and a restarted worker, whose cache is empty, gets its share too.
    question = rng.choice(TOPICS)
    if rng.random() < 0.5:
        prompt = f"{SHARED_PREFIX}{question} (#{rng.randrange(1000)})"
    else:
        prompt = f"Request {rng.randrange(10**6)}. {SHARED_PREFIX}{question}"
    body: dict = {
        "model": model,
        "max_tokens": rng.randint(*max_tokens),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "stream": kind.endswith("+stream"),
    }
    if kind.startswith("chat"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def plain(client: httpx.AsyncClient, path: str, body: dict) -> tuple[str, str]:
    r = await client.post(path, json=body)
    if r.status_code != 200:
        return "failed", f"HTTP {r.status_code}: {r.text[:200]}"
    choices = r.json().get("choices") or []
    if not choices or choices[0].get("finish_reason") is None:
        return "failed", f"no finished choice in {r.text[:200]}"
    return "ok", ""


async def streamed(
    client: httpx.AsyncClient, path: str, body: dict, hang_up_after: int | None
) -> tuple[str, str]:
    """Reads SSE events to [DONE]; with hang_up_after, closes the connection after that many."""
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return "failed", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return "ok", ""
            event = json.loads(data)
            if "error" in event:
                return "failed", f"error event: {json.dumps(event['error'])[:200]}"
            events += 1
            if hang_up_after is not None and events >= hang_up_after:
                return "cancelled", ""  # leaving the block closes the connection mid-stream
    return "failed", "stream ended without [DONE]"


async def one_request(client: httpx.AsyncClient, load: Load, rng: random.Random) -> Result:
    kind = rng.choice(KINDS)
    path = "/v1/chat/completions" if kind.startswith("chat") else "/v1/completions"
    body = request_body(kind, load.model, rng, load.max_tokens)
    hang_up = rng.randint(1, 4) if body["stream"] and rng.random() < load.disconnect_prob else None
    start = time.perf_counter()
    try:
        if body["stream"]:
            outcome, error = await streamed(client, path, body, hang_up)
        else:
            outcome, error = await plain(client, path, body)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        outcome, error = "failed", f"{type(e).__name__}: {e}"
    return Result(kind, outcome, start - load.t0, time.perf_counter() - start, error)


async def client_loop(load: Load, seed: int, until: float, record: bool) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=load.base_url, timeout=120) as client:
        while time.perf_counter() < until:
            result = await one_request(client, load, rng)
            if record:
                load.results.append(result)


async def run_clients(load: Load, clients: int, seconds: float, seed: int, record: bool = True) -> None:
    until = time.perf_counter() + seconds
    await asyncio.gather(*(client_loop(load, seed * 1000 + i, until, record) for i in range(clients)))


# -- the mesh: stats, RSS, the kill ----------------------------------------------------


def get_stats(address: str):
    from llmesh.v1 import worker_pb2, worker_pb2_grpc
    from services.grpc_server import open_sync_channel

    with open_sync_channel(address) as channel:  # carries the mesh secret main() put in the environment
        return worker_pb2_grpc.RegistryStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=10)


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def rss_by_service(mesh: LocalMesh) -> dict[str, float | None]:
    return {c.name: rss_mib(c.proc.pid) for c in mesh.children}


async def wait_for(check, timeout: float, interval: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(check):
            return True
        await asyncio.sleep(interval)
    return False


async def kill_one_worker(
    mesh: LocalMesh, sup: Supervisor, load: Load, at_s: float, settle_s: float, rss: dict
) -> KillReport:
    """SIGKILLs the last worker at `at_s`; once it is back and warmed up, records its RSS baseline."""
    victim = mesh.workers[-1]
    report = KillReport()
    await asyncio.sleep(max(at_s - (time.perf_counter() - load.t0), 0))
    os.kill(victim.proc.pid, signal.SIGKILL)
    killed = time.perf_counter()
    report.at_s = killed - load.t0
    print(f"  t={report.at_s:.1f}s  SIGKILL {victim.name} (pid {victim.proc.pid})", flush=True)

    def rejoined() -> bool:
        if sup.restarts(victim.name) < 1:
            return False
        return any(
            w.worker_id == victim.name and w.connected for w in get_stats(mesh.scheduler.address).workers
        )

    if not await wait_for(rejoined, timeout=120):
        print(f"  {victim.name} did not rejoin within 120 s", flush=True)
        return report
    report.rejoined_after_s = time.perf_counter() - killed
    report.restarted_pid = victim.proc.pid
    print(
        f"  {victim.name} back (pid {victim.proc.pid}) {report.rejoined_after_s:.1f} s after SIGKILL",
        flush=True,
    )
    # A fresh process grows while it serves its first requests: its baseline comes after that warm-up.
    await asyncio.sleep(settle_s)
    rss[victim.name] = rss_mib(victim.proc.pid)
    return report


async def wait_blocks_free(address: str, timeout: float = 30.0):
    def all_free() -> bool:
        s = get_stats(address)
        return bool(s.workers) and all(
            w.free_blocks == w.num_blocks and w.running == 0 and w.waiting == 0 for w in s.workers
        )

    await wait_for(all_free, timeout)
    return await asyncio.to_thread(get_stats, address)


# -- report -----------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def print_requests(results: list[Result], duration_s: float) -> None:
    print(f"\n{'requests':<22}{'ok':>7}{'failed':>8}{'cancelled':>11}{'p50 s':>9}{'p99 s':>9}")
    for kind in [*KINDS, "all"]:
        rows = [r for r in results if kind in ("all", r.kind)]
        ok = [r.latency_s for r in rows if r.outcome == "ok"]
        failed = sum(r.outcome == "failed" for r in rows)
        cancelled = sum(r.outcome == "cancelled" for r in rows)
        p50, p99 = percentile(ok, 50), percentile(ok, 99)
        print(f"{kind:<22}{len(ok):>7}{failed:>8}{cancelled:>11}{p50:>9.2f}{p99:>9.2f}")
    print(f"throughput: {sum(r.outcome == 'ok' for r in results) / duration_s:.2f} ok requests/s")


def print_kill_window(results: list[Result], kill: KillReport) -> None:
    if kill.at_s is None:
        return
    hit = [r for r in results if r.started_s <= kill.at_s <= r.started_s + r.latency_s]
    outcomes = {o: sum(r.outcome == o for r in hit) for o in ("ok", "failed", "cancelled")}
    slowest = max((r.latency_s for r in hit), default=0.0)
    print(f"in flight at the SIGKILL: {len(hit)} requests {outcomes}, slowest {slowest:.1f} s")


def print_failures(results: list[Result], kill: KillReport, limit: int = 8) -> None:
    failed = [r for r in results if r.outcome == "failed"]
    if not failed:
        return
    print(f"\nfailures ({len(failed)}; t = seconds since the load began, the kill at t={kill.at_s}):")
    for r in failed[:limit]:
        print(f"  t={r.started_s:7.1f}s  {r.kind:<20} {r.error}")


def rss_growth(start: dict[str, float | None], end: dict[str, float | None]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, before in start.items():
        after = end.get(name)
        out[name] = None if not before or after is None else 100 * (after - before) / before
    return out


def print_rss(start: dict, end: dict, growth: dict, restarted: set[str]) -> None:
    print(f"\n{'service':<12}{'RSS start MiB':>15}{'RSS end MiB':>13}{'growth':>9}")
    for name in start:
        label = name + ("*" if name in restarted else "")
        s, e, g = start[name], end.get(name), growth[name]
        cells = [f"{s:.0f}" if s else "-", f"{e:.0f}" if e else "-", f"{g:+.1f}%" if g is not None else "-"]
        print(f"{label:<12}{cells[0]:>15}{cells[1]:>13}{cells[2]:>9}")
    if restarted:
        print("* restarted: its start figure is from after it rejoined and warmed up again")


def print_blocks(stats) -> None:
    print("\nKV blocks after the load (free / total):")
    for w in sorted(stats.workers, key=lambda w: w.worker_id):
        print(
            f"  {w.worker_id:<10} {w.free_blocks:>5} / {w.num_blocks:<5} running {w.running}"
            f" waiting {w.waiting}  steps {w.steps}  reconnects {w.reconnects}"
        )
    print(f"  failovers {stats.failovers}, active requests {stats.active_requests}")


def check_targets(
    results, growth, stats, kill: KillReport | None, num_workers: int, max_growth: float
) -> bool:
    """Each target passed or missed (printed); `kill` None: no worker was to be killed (--no-kill)."""
    failed = sum(r.outcome == "failed" for r in results)
    worst = max((g for g in growth.values() if g is not None), default=float("nan"))
    free = all(w.free_blocks == w.num_blocks for w in stats.workers) and len(stats.workers) == num_workers
    targets = [
        (f"failed requests == 0 (got {failed})", failed == 0),
        (f"RSS growth <= {max_growth:g} % (worst {worst:+.1f} %)", worst <= max_growth),
        ("every KV block free after the load", free),
    ]
    if kill is not None:
        targets.append(("the killed worker rejoined", kill.rejoined_after_s is not None))
    print("\ntargets:")
    for text, ok in targets:
        print(f"  [{'pass' if ok else 'MISS'}] {text}")
    return all(ok for _, ok in targets)


# -- main -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=600.0, help="length of the measured load")
    ap.add_argument("--warmup-s", type=float, default=15.0, help="load before the RSS baseline")
    ap.add_argument("--clients", type=int, default=6, help="concurrent HTTP clients")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kill-at", type=float, default=1 / 3, help="fraction of the run when a worker dies")
    ap.add_argument("--no-kill", action="store_true", help="no SIGKILL (a baseline run)")
    ap.add_argument("--disconnect-prob", type=float, default=0.15, help="share of streams hung up early")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(8, 48), metavar=("MIN", "MAX"))
    ap.add_argument("--kv-cache-memory", type=int, default=128 << 20, help="bytes of KV cache per worker")
    ap.add_argument("--max-rss-growth-pct", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None, help="service logs (default: a new temporary folder)")
    ap.add_argument("--smoke", action="store_true", help="seconds, one worker, no SIGKILL (make test)")
    args = ap.parse_args(argv)
    if args.smoke:  # the whole path in seconds; an RSS figure over them says nothing, so no target
        args.duration_s, args.warmup_s, args.clients, args.workers, args.no_kill = 2.0, 0.5, 2, 1, True
        args.max_tokens, args.max_rss_growth_pct = (2, 6), float("inf")
        print("smoke: one worker, no SIGKILL, no RSS target")
    return args


def start(args: argparse.Namespace) -> tuple[LocalMesh, Supervisor]:
    mesh = start_mesh(
        args.workers,
        gateway_port=0,
        worker_args=["--kv-cache-memory", str(args.kv_cache_memory)],
        log_dir=args.log_dir,
    )
    return mesh, Supervisor(mesh, Backoff()).start()


async def soak(args: argparse.Namespace, mesh: LocalMesh, sup: Supervisor) -> bool:
    base_url = f"http://{mesh.gateway.address}"
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
    load = Load(base_url, model, tuple(args.max_tokens), args.disconnect_prob)

    print(f"warm-up {args.warmup_s:.0f} s ...", flush=True)
    load.t0 = time.perf_counter()
    await run_clients(load, args.clients, args.warmup_s, args.seed + 1, record=False)
    rss_start = rss_by_service(mesh)

    print(f"load {args.duration_s:.0f} s, {args.clients} clients ...", flush=True)
    load.t0 = time.perf_counter()
    kill = KillReport()
    tasks = [run_clients(load, args.clients, args.duration_s, args.seed)]
    if not args.no_kill:
        settle = min(args.warmup_s, args.duration_s / 6)
        tasks.append(kill_one_worker(mesh, sup, load, args.duration_s * args.kill_at, settle, rss_start))
    outcome = await asyncio.gather(*tasks)
    if not args.no_kill:
        kill = outcome[1]
    elapsed = time.perf_counter() - load.t0

    stats = await wait_blocks_free(mesh.scheduler.address)
    rss_end = rss_by_service(mesh)
    growth = rss_growth(rss_start, rss_end)
    restarted = {c.name for c in mesh.children if sup.restarts(c.name)}

    print(f"\nsoak: {elapsed:.0f} s of load, {args.clients} clients, {args.workers} workers (CPU)")
    if kill.at_s is not None:
        back = f"{kill.rejoined_after_s:.1f} s later" if kill.rejoined_after_s is not None else "NOT back"
        victim = mesh.workers[-1].name
        print(f"{victim} SIGKILLed at t={kill.at_s:.1f}s, restarted by the supervisor, back {back}")
    print_requests(load.results, elapsed)
    print_kill_window(load.results, kill)
    print_failures(load.results, kill)
    print_rss(rss_start, rss_end, growth, restarted)
    print_blocks(stats)
    killed = None if args.no_kill else kill
    return check_targets(load.results, growth, stats, killed, args.workers, args.max_rss_growth_pct)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The mesh's secret, in this process's environment as a deployment gives it: the mesh's
    # children and this benchmark's stats calls (internal RPCs) carry the same key.
    os.environ.setdefault(ENV_KEY, new_key())
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="llmesh-soak-")
    print(f"service logs: {args.log_dir}", flush=True)
    mesh, sup = start(args)
    try:
        ok = asyncio.run(soak(args, mesh, sup))
    finally:
        sup.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
