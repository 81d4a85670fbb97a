"""`llmesh up --schedulers 2 --workers 2`: a router in front of two scheduler shards with a real
SmolLM2 worker each, a KV store and the gateway, as processes on loopback.

The official `openai` client is served through the router unchanged (the gateway asks the router for
a shard and streams from that shard: a stream goes on with the router stopped); a long prefix
repeated is served from cache whichever shard it lands on (the router alternates them here, round-
robin: the shard that computed it has it in its GPU cache, the other loads it from the KV store);
SIGKILL of one shard under 8 streams: the streams on the other shard finish, those on the dead one
end with an error at once (none hangs), every request started afterwards succeeds, and the shard,
started again as the supervisor would, rejoins the router.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from services.launcher import LocalMesh, child_ready, start_mesh
from tests.integration.conftest import service_logs
from tests.integration.test_mesh import stats, wait_for

CHUNK_TOKENS = 64
SYSTEM = (
    "You are the archivist of a lighthouse on a cold northern coast. You keep the logbook of every "
    "ship that passes, the weather of each hour, the state of the lamp and its clockwork, and the "
    "stores of oil, wick and bread. You answer questions about the logbook briefly and exactly, "
    "quoting dates and names where you can, and you never invent a ship that is not in the book. "
) * 3


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> LocalMesh:
    logs = tmp_path_factory.mktemp("router-mesh")
    try:
        mesh = start_mesh(
            2,
            num_schedulers=2,
            gateway_port=0,
            kvstore=True,
            worker_args=["--kv-cache-memory", str(64 << 20), "--kv-chunk-tokens", str(CHUNK_TOKENS)],
            router_args=["--policy", "round-robin", "--load-interval-ms", "50"],
            log_dir=str(logs),
        )
    except Exception as e:
        raise RuntimeError(f"the sharded mesh did not start: {e}\n{service_logs(logs)}") from e
    mesh.log_dir = logs  # type: ignore[attr-defined]
    yield mesh
    mesh.stop()


@pytest.fixture
def client(sharded: LocalMesh):
    import openai

    return openai.OpenAI(
        base_url=f"http://{sharded.gateway.address}/v1", api_key="unused", max_retries=0, timeout=120
    )


def ask(client, question: str, max_tokens: int = 8):
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
    )


def test_a_repeated_prefix_is_served_from_cache_on_either_shard(sharded: LocalMesh, client):
    assert sharded.scheduler.name == "router" and len(sharded.shards) == 2
    first = ask(client, "Which ship passed on the first of March?")
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 2 * CHUNK_TOKENS
    # The shard that computed it put its chunks to the KV store (the other shard loads them there).
    wait_for(
        lambda: sum(w.stored_chunks for w in stats(sharded.scheduler.address).workers) >= 2,
        "the prefix's chunks put to the KV store",
        60,
    )
    cached = []
    for i in range(4):  # round-robin: two land on each shard
        reply = ask(client, f"How much oil was left on day {i + 2}?")
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert all(c >= 2 * CHUNK_TOKENS for c in cached), cached
    per_worker = {w.worker_id: w.prefix_hits for w in stats(sharded.scheduler.address).workers}
    assert len(per_worker) == 2 and all(hits > 0 for hits in per_worker.values()), per_worker


def test_the_gateway_streams_from_the_shard_not_through_the_router(sharded: LocalMesh, client):
    """`llmesh up --schedulers N` starts the gateway with --direct-to-shards: the router only picks
    (ShardPicker.Route). A stream that started goes on to its end with the router stopped."""
    chunks = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Count slowly from one to one hundred."}],
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    stream = iter(chunks)
    next(stream)
    router = sharded.scheduler.proc
    router.send_signal(signal.SIGSTOP)  # a relay would stall here
    try:
        rest = list(stream)
    finally:
        router.send_signal(signal.SIGCONT)
    assert rest and rest[-1].choices[0].finish_reason == "length"


def test_sigkill_of_a_shard_under_streams(sharded: LocalMesh, client):
    results: dict[int, str] = {}

    def stream(i: int) -> None:
        try:
            chunks = client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": f"Count slowly from {i} to one hundred."}],
                max_tokens=64,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in chunks:
                pass
            results[i] = "ok"
        except Exception as e:  # the openai client's error for a failed stream
            results[i] = type(e).__name__

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    victim = sharded.shards[0]
    wait_for(lambda: stats(victim.address).active_requests > 0, "streams on the first shard", 60)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    started = time.monotonic()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    assert time.monotonic() - started < 100
    assert list(results.values()).count("ok") >= 4, results  # those on the other shard finished
    # With one shard dead, every new request succeeds (the router routes around it).
    for i in range(4):
        assert ask(client, f"Which lamp part broke in week {i}?").choices[0].message.content is not None
    # The shard comes back (as the supervisor starts it again, same port and id) and rejoins.
    victim.respawn()
    wait_for(lambda: child_ready(victim), "the restarted shard", 120)
    wait_for(lambda: len(stats(sharded.scheduler.address).workers) == 2, "both shards' workers", 60)
    for i in range(4):
        assert ask(client, f"Who kept the lamp in year {i}?").usage.completion_tokens > 0
    shards = {w.worker_id.split("/")[0] for w in stats(sharded.scheduler.address).workers}
    assert shards == {s.address for s in sharded.shards}  # shard ids: their addresses here
