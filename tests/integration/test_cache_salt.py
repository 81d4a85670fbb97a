"""Tenant isolation of the prefix cache on a real mesh (scheduler + worker + KV store on loopback).

Two tenants with different `cache_salt`s send the same prompt: the second gets no prefix-cache
hit (neither the worker's GPU cache nor the KV store, by the workers' counters and its own usage)
and the same greedy tokens; the same salt again shares the cached blocks.
"""

from __future__ import annotations

import random

import grpc
import pytest

from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from llmesh.v1 import worker_pb2, worker_pb2_grpc
from services.grpc_server import open_sync_channel
from services.launcher import start_mesh
from tests.integration.conftest import service_logs
from tests.integration.test_mesh import wait_for

MAX_TOKENS = 4
CHUNK_TOKENS = 32
# 6 full blocks of 16 (3 store chunks of 32) and a few tokens: the last token is always computed.
PROMPT = [random.Random(11).randrange(100, 40000) for _ in range(100)]


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory) -> str:
    logs = tmp_path_factory.mktemp("cache-salt-logs")
    worker_args = ["--kv-cache-memory", str(64 << 20), "--kv-chunk-tokens", str(CHUNK_TOKENS)]
    try:
        mesh = start_mesh(1, worker_args=worker_args, kvstore=True, log_dir=str(logs))
    except Exception as e:
        raise RuntimeError(f"the mesh did not start: {e}\n{service_logs(logs)}") from e
    with mesh:
        yield mesh.scheduler.address


def worker_stats(address: str) -> worker_pb2.WorkerStats:
    """The worker's counters (Registry.GetStats, with the mesh's internal key when it has one)."""
    with open_sync_channel(address) as channel:
        stats = worker_pb2_grpc.RegistryStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=10)
    return stats.workers[0]


def generate(address: str, salt: str) -> tuple[list[int], int]:
    """Greedy tokens of PROMPT under `salt` and its cached prompt tokens (usage)."""
    req = g.GenerateRequest(
        prompt_token_ids=g.TokenIds(ids=PROMPT),
        sampling_params=g.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        cache_salt=salt,
    )
    tokens, cached = [], -1
    with open_sync_channel(address) as channel:
        for resp in gg.SchedulerStub(channel).Generate(req, timeout=120):
            tokens.extend(resp.token_ids)
            if resp.HasField("usage"):
                cached = resp.usage.cached_prompt_tokens
    return tokens, cached


def hits(address: str) -> tuple[int, int, int]:
    """(GPU prefix-cache hits, host-tier hits, KV-store hits) in prompt tokens, so far."""
    w = worker_stats(address)
    return w.prefix_hits, w.host_hit_tokens, w.store_hit_tokens


def test_tenants_with_different_salts_share_nothing_and_one_salt_shares(scheduler):
    first, cached = generate(scheduler, "tenant-a")
    assert cached == 0 and len(first) == MAX_TOKENS
    # A's chunks reach the store: the strongest test that B cannot hit (or probe) them there.
    wait_for(lambda: worker_stats(scheduler).stored_chunks >= 3, "tenant a's chunks stored")

    before = hits(scheduler)
    assert generate(scheduler, "tenant-b") == (first, 0)  # no hit, the same greedy tokens
    assert generate(scheduler, "") == (first, 0)  # unsalted requests are a tenant of their own
    assert hits(scheduler) == before  # no GPU, host or store hit for anyone else

    again, cached = generate(scheduler, "tenant-a")
    assert (again, cached) == (first, 96)  # the same salt shares its 6 full blocks
    assert hits(scheduler)[0] == before[0] + 96


def test_an_oversized_salt_is_invalid_argument(scheduler):
    req = g.GenerateRequest(prompt_token_ids=g.TokenIds(ids=[1, 2, 3]), cache_salt="é" * 129)
    with open_sync_channel(scheduler) as channel, pytest.raises(grpc.RpcError) as e:
        list(gg.SchedulerStub(channel).Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("cache_salt: ")
