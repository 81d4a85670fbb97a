"""A prefix computed on one worker is loaded on another from the KV store (real processes, real Redis).

Two meshes (scheduler + worker each) share one `kvstore` service whose slower
tier is a real redis-server: the second worker, with a cold GPU cache, loads the
first one's chunks and computes only the rest, with the same greedy tokens.
The store restarts (its memory is lost, Redis keeps the chunks); Redis dies
mid-run (every request still completes, computed instead).
"""

from __future__ import annotations

import random
import time

import pytest

from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from services.grpc_server import open_sync_channel
from services.launcher import _start_kvstore, grpc_serving, start_mesh, wait_until
from tests.helpers.redis_server import RedisServer
from tests.integration.conftest import service_logs
from tests.integration.test_mesh import stats, wait_for

CHUNK_TOKENS = 64
MAX_TOKENS = 8


def worker_stats(address: str):
    return stats(address).workers[0]


def generate_ids(address: str, prompt: list[int]) -> list[int]:
    req = g.GenerateRequest(
        prompt_token_ids=g.TokenIds(ids=prompt),
        sampling_params=g.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    with open_sync_channel(address) as channel:
        return [t for r in gg.SchedulerStub(channel).Generate(req, timeout=120) for t in r.token_ids]


def long_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def reference():
    from llmesh import LLM, SamplingParams

    prompts = long_prompts(4, 300, seed=5)
    llm = LLM(kv_cache_memory=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def cluster(tmp_path):
    """redis-server + kvstore + two meshes that know only the store in common."""
    logs = tmp_path / "logs"
    logs.mkdir()
    redis = RedisServer(tmp_path / "redis").start()
    kv_args = ["--memory-bytes", str(256 << 20), "--redis-url", redis.url, "--redis-timeout-s", "0.3"]
    kvstore = _start_kvstore("127.0.0.1", 0, kv_args, {}, str(logs))
    meshes = []
    try:
        wait_until(lambda: grpc_serving(kvstore.address), "kvstore", [kvstore.proc], 60)
        kv = ["--kvstore-address", kvstore.address]
        worker_args = ["--kv-cache-memory", str(64 << 20), "--kv-chunk-tokens", str(CHUNK_TOKENS), *kv]
        for _ in range(2):
            meshes.append(start_mesh(1, worker_args=worker_args, scheduler_args=kv, log_dir=str(logs)))
        yield redis, kvstore, meshes[0].scheduler.address, meshes[1].scheduler.address, kv_args
    except BaseException as e:
        raise RuntimeError(f"{e}\n{service_logs(logs)}") from e
    finally:
        for m in meshes:
            m.stop()
        kvstore.proc.terminate()
        kvstore.proc.wait(20)
        redis.stop()


def stored(address: str, chunks: int) -> None:
    wait_for(lambda: worker_stats(address).stored_chunks >= chunks, f"{chunks} chunks put to the store")
    time.sleep(0.5)  # the worker's background sender delivers them


def test_a_prefix_computed_on_one_worker_is_loaded_by_another(cluster, reference):
    redis, kvstore, first, second, kv_args = cluster
    prompts, expected = reference
    full_chunks = (300 - 1) // CHUNK_TOKENS  # the last token is always computed

    assert generate_ids(first, prompts[0]) == expected[0]
    stored(first, full_chunks)
    assert generate_ids(second, prompts[0]) == expected[0]
    w = worker_stats(second)
    assert w.store_hit_tokens == full_chunks * CHUNK_TOKENS  # computed only the rest
    assert w.prefix_hits == full_chunks * CHUNK_TOKENS and w.failed_loads == 0

    # The store restarts: its memory is gone, Redis still holds what the first worker put.
    assert generate_ids(first, prompts[1]) == expected[1]
    stored(first, 2 * full_chunks)
    kvstore.proc.kill()
    kvstore.proc.wait(10)
    kvstore.respawn()
    wait_until(lambda: grpc_serving(kvstore.address), "kvstore", [kvstore.proc], 60)
    time.sleep(2.5)  # the services' channels re-dial within their 2 s reconnect backoff
    assert generate_ids(second, prompts[1]) == expected[1]
    assert worker_stats(second).store_hit_tokens == 2 * full_chunks * CHUNK_TOKENS

    # Redis dies mid-run: every request completes, the prefixes computed instead.
    redis.kill()
    assert generate_ids(first, prompts[2]) == expected[2]
    assert generate_ids(second, prompts[3]) == expected[3]
    assert generate_ids(second, prompts[2]) == expected[2]
    for address in (first, second):
        wait_for(lambda a=address: worker_stats(a).free_blocks == worker_stats(a).num_blocks, "blocks freed")
