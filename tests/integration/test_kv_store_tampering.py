"""Redis is untrusted storage: entries altered, forged, swapped or truncated there change no output.

A writer mesh computes four prompts, whose chunks its worker puts to a `kvstore` service whose
only tier is a real redis-server (with a password). Then, with the password, as anyone who can
reach Redis could: the first chunk of each prompt is attacked in another way, under keys
computed from the prompt as a worker computes them. A reader mesh with a cold cache gets the
same greedy tokens for every prompt (the attacked chunks are misses, computed instead), and its
gateway's /metrics counts the chunks whose MAC failed.
"""

from __future__ import annotations

import dataclasses
import os

import httpx
import pytest

from kvstore_svc.tiers.base import EntryKey
from kvstore_svc.tiers.redis_tier import redis_key
from llmesh.v1 import worker_pb2, worker_pb2_grpc
from scheduler_svc.prefix_hash import extend_block_keys
from services.grpc_server import open_sync_channel
from services.kv_entry import checksum, decode_entry, encode_entry
from services.launcher import _start_kvstore, grpc_serving, start_mesh, wait_until
from services.step import store_fingerprint
from tests.helpers.redis_server import RedisServer
from tests.integration.conftest import service_logs
from tests.integration.test_kv_store_mesh import CHUNK_TOKENS, MAX_TOKENS, generate_ids, long_prompts, stored
from tests.integration.test_mesh import stats

PROMPT_TOKENS = 200
ATTACKS = ("altered", "swapped", "forged", "truncated")


@pytest.fixture(scope="module")
def reference():
    from llmesh import LLM, SamplingParams

    prompts = long_prompts(len(ATTACKS), PROMPT_TOKENS, seed=11)
    llm = LLM(kv_cache_memory=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def chunk_keys(worker_address: str, prompt: list[int]) -> tuple[bytes, list[bytes]]:
    """(store fingerprint, the prompt's chunk keys), as the worker names them in the store."""
    with open_sync_channel(worker_address) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).GetWorkerInfo(
            worker_pb2.GetWorkerInfoRequest(), timeout=10
        )
    chunk = info.kv_chunk_blocks
    keys = extend_block_keys([], prompt, info.block_size, info.fingerprint)
    return store_fingerprint(info.fingerprint, chunk), keys[chunk - 1 :: chunk]


def attack(r, fp: bytes, how: str, target: bytes, other: bytes) -> None:
    """Rewrite the entry of `target` in Redis (`other`: a valid entry of another chunk)."""
    name = redis_key(EntryKey(fp, target))
    blob = r.get(name)
    header, payload = decode_entry(blob)
    if how == "altered":  # one bit of the payload, with a valid checksum: only the MAC can tell
        changed = bytearray(payload)
        changed[len(changed) // 2] ^= 0x10
        r.set(name, encode_entry(dataclasses.replace(header, checksum=checksum(changed)), bytes(changed)))
    elif how == "swapped":  # another chunk's valid entry under this key
        r.set(name, r.get(redis_key(EntryKey(fp, other))))
    elif how == "forged":  # made from nothing: random values, a valid checksum, a made-up MAC
        noise = os.urandom(len(payload))
        forged = dataclasses.replace(header, checksum=checksum(noise), mac=os.urandom(32))
        r.set(name, encode_entry(forged, noise))
    elif how == "truncated":  # the store's own checks refuse it (a miss, not a MAC failure)
        r.set(name, blob[: len(blob) // 2])
    else:
        raise AssertionError(how)


def verify_failures(metrics: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("llmesh:kv_store_verify_failures_total")
    )


def test_tampered_redis_entries_never_change_any_output(tmp_path, reference) -> None:
    prompts, expected = reference
    logs = tmp_path / "logs"
    logs.mkdir()
    redis = RedisServer(tmp_path / "redis").start()
    kv_args = ["--memory-bytes", "0", "--redis-url", redis.url]  # Redis is the store's only tier
    kvstore = _start_kvstore("127.0.0.1", 0, kv_args, {}, str(logs))
    meshes = []
    try:
        wait_until(lambda: grpc_serving(kvstore.address), "kvstore", [kvstore.proc], 60)
        kv = ["--kvstore-address", kvstore.address]
        worker_args = ["--kv-cache-memory", str(64 << 20), "--kv-chunk-tokens", str(CHUNK_TOKENS), *kv]
        writer = start_mesh(1, worker_args=worker_args, scheduler_args=kv, log_dir=str(logs))
        meshes.append(writer)
        for p, want in zip(prompts, expected, strict=True):
            assert generate_ids(writer.scheduler.address, p) == want
        per_prompt = (PROMPT_TOKENS - 1) // CHUNK_TOKENS
        stored(writer.scheduler.address, len(prompts) * per_prompt)

        r = redis.client()
        for p, how in zip(prompts, ATTACKS, strict=True):
            fp, keys = chunk_keys(writer.workers[0].address, p)
            assert r.exists(redis_key(EntryKey(fp, keys[0])))
            attack(r, fp, how, target=keys[0], other=keys[1])

        reader = start_mesh(1, gateway_port=0, worker_args=worker_args, scheduler_args=kv, log_dir=str(logs))
        meshes.append(reader)
        for p, want in zip(prompts, expected, strict=True):
            assert generate_ids(reader.scheduler.address, p) == want  # computed instead, the same tokens
        w = stats(reader.scheduler.address).workers[0]
        assert w.kv_verify_failures == 3  # altered, swapped, forged; the truncated one was a plain miss
        assert w.failed_loads == len(ATTACKS)  # each prompt's load stopped at its first chunk: computed
        metrics = httpx.get(f"http://{reader.gateway.address}/metrics", timeout=10).text
        assert verify_failures(metrics) == 3
    except BaseException as e:
        raise RuntimeError(f"{e}\n{service_logs(logs)}") from e
    finally:
        for m in meshes:
            m.stop()
        kvstore.proc.terminate()
        kvstore.proc.wait(20)
        redis.stop()
