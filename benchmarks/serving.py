"""Serving load: concurrent streaming clients against the gateway, with the in-process engine beside it.

At each concurrency level, `concurrency` clients loop over a seeded random
workload (token-id prompts of --prompt-len, --output-len tokens each with
ignore_eos, greedy) through POST /v1/completions with stream=true, and we
report TTFT, inter-token latency (between a request's successive SSE chunks)
and end-to-end latency percentiles, plus request and output-token throughput.
The offline engine (`llmesh.LLM`, same model, same requests, no sockets) then
runs the whole workload at once: the ceiling the mesh is measured against.

    .venv/bin/python benchmarks/serving.py                       # starts its own mesh on loopback
    .venv/bin/python benchmarks/serving.py --url http://127.0.0.1:8000 --skip-engine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestStats:
    ok: bool = False
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def make_workload(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(prompt_len)] for _ in range(n)]


async def one_request(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> RequestStats:
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    st = RequestStats()
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                st.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return st
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    st.error = chunk["error"]["message"]
                    return st
                if chunk.get("usage"):
                    st.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if st.ttft is None:
                        st.ttft = now - t0
                    else:
                        st.itl.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        st.error = repr(e)
        return st
    st.e2e = time.perf_counter() - t0
    st.ok = True
    return st


async def run_level(
    url: str, prompts: list[list[int]], output_len: int, concurrency: int
) -> tuple[list, float]:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestStats] = []
    limits = httpx.Limits(max_connections=concurrency + 4)

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600), limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                results.append(await one_request(client, queue.get_nowait(), output_len))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def report(concurrency: int, results: list[RequestStats], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(ok),
        "failed": len(results) - len(ok),
        "req_s": len(ok) / wall,
        "tok_s": tokens / wall,
        "ttft_p50_ms": 1000 * pct(ttft, 50),
        "ttft_p90_ms": 1000 * pct(ttft, 90),
        "ttft_p99_ms": 1000 * pct(ttft, 99),
        "itl_p50_ms": 1000 * pct(itl, 50),
        "itl_p90_ms": 1000 * pct(itl, 90),
        "itl_p99_ms": 1000 * pct(itl, 99),
        "e2e_p50_s": pct(e2e, 50),
        "e2e_mean_s": statistics.fmean(e2e) if e2e else float("nan"),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def bench_engine(prompts: list[list[int]], output_len: int, kv_cache_memory: int) -> float:
    """Output tokens/s of the in-process engine on the same requests, all submitted at once."""
    from llmesh import LLM, SamplingParams

    llm = LLM(kv_cache_memory=kv_cache_memory)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch[:2], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="gateway base URL (default: start a local mesh)")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    ap.add_argument("--requests-per-client", type=int, default=4, help="requests per client at each level")
    ap.add_argument("--min-requests", type=int, default=8, help="fewest requests at a level")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes of KV cache per worker")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-engine", action="store_true", help="do not run the in-process engine")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    levels = [int(c) for c in args.concurrency.split(",")]
    mesh = None
    url = args.url
    if url is None:
        from services.launcher import start_mesh

        print(f"starting a local mesh ({args.workers} worker(s)) ...", flush=True)
        mesh = start_mesh(
            args.workers,
            gateway_port=0,
            worker_args=["--kv-cache-memory", str(args.kv_cache_memory)],
            log_dir=tempfile.mkdtemp(prefix="llmesh-bench-"),
        )
        url = f"http://{mesh.gateway.address}"
    rows = []
    largest: list[list[int]] = []
    try:
        vocab = 49152
        asyncio.run(run_level(url, make_workload(2, args.prompt_len, vocab, args.seed + 99), 8, 2))  # warm-up
        for i, c in enumerate(levels):
            n = max(args.min_requests, c * args.requests_per_client)
            prompts = make_workload(n, args.prompt_len, vocab, args.seed + i)
            results, wall = asyncio.run(run_level(url, prompts, args.output_len, c))
            rows.append(report(c, results, wall))
            largest = prompts
            print(f"concurrency {c}: {rows[-1]}", flush=True)
    finally:
        if mesh is not None:
            mesh.stop()
    engine_tok_s = None
    if not args.skip_engine and largest:
        engine_tok_s = bench_engine(largest, args.output_len, args.kv_cache_memory)

    print(
        f"\nworkload: prompt {args.prompt_len} tokens, output {args.output_len} tokens (ignore_eos, greedy), "
        "streaming /v1/completions"
    )
    head = (
        f"{'clients':>7} {'reqs':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'p90':>7} {'p99':>7} "
        f"{'ITL p50':>8} {'p90':>6} {'p99':>6} {'E2E p50 s':>10}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['concurrency']:>7} {r['requests']:>5} {r['req_s']:>7.2f} {r['tok_s']:>10.1f} "
            f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p90_ms']:>5.0f}ms {r['ttft_p99_ms']:>5.0f}ms "
            f"{r['itl_p50_ms']:>6.0f}ms {r['itl_p90_ms']:>4.0f}ms {r['itl_p99_ms']:>4.0f}ms "
            f"{r['e2e_p50_s']:>10.2f}" + (f"  ({r['failed']} failed: {r['errors']})" if r["failed"] else "")
        )
    if engine_tok_s is not None:
        print(
            f"in-process engine (LLM.generate, the same {len(largest)} requests at once): "
            f"{engine_tok_s:.1f} out tok/s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "levels": rows, "engine_tok_s": engine_tok_s}, f, indent=2)


if __name__ == "__main__":
    main()
