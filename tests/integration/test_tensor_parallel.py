"""Tensor parallelism at size 2 on the CPU (gloo, rank processes on loopback).

Greedy tokens must equal size 1's token for token (fp32), through the offline engine and
through a real worker service behind a scheduler; a lost rank must end the worker loudly, and
the ranks must not outlive their worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from llmesh import LLM, SamplingParams
from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from services.grpc_server import open_sync_channel
from services.launcher import free_port, grpc_serving, start_mesh
from tests.helpers.tiny_models import make_tiny_model
from worker_svc.service import EXIT_RANK_LOST

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(20, 60))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(kv_cache_memory=1 << 22, max_num_seqs=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-models")
    return {
        "llama": make_tiny_model(root / "llama", "llama", seed=3),
        # Biases on q/k/v, a tied embedding, and a vocabulary that 2 does not divide (padded).
        "qwen2": make_tiny_model(root / "qwen2", "qwen2", seed=4, tie_word_embeddings=True, vocab_size=509),
    }


def greedy(path: str, size: int, prompts=PROMPTS) -> list[list[int]]:
    llm = LLM(path, tensor_parallel_size=size, **ENGINE)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_size_2_greedy_equals_size_1(models, name):
    assert greedy(models[name], 2) == greedy(models[name], 1)


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        {"method": "draft_model", "num_speculative_tokens": 3, "num_layers": 1},  # whole on rank 0
    ],
    ids=["ngram", "draft-model"],
)
def test_speculative_decoding_at_size_2_keeps_greedy_tokens(models, spec):
    prompts = [[5, 6, 7, 8] * 5, [100, 200, 300] * 4]
    llm = LLM(
        models["llama"],
        tensor_parallel_size=2,
        speculative_config={**spec, "disable_by_batch_size": 0},
        **ENGINE,
    )
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.engine.mesh.workers["local"].planner.spec.stats.num_drafts > 0
    finally:
        llm.engine.close()
    assert got == greedy(models["llama"], 1, prompts)


def test_a_size_that_does_not_divide_the_heads_is_refused(models):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the query heads"):
        LLM(models["llama"], tensor_parallel_size=3, **ENGINE)


def _children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc: no psutil needed)."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(entry))
    return kids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.1)


def _generate(address: str, prompt: list[int]) -> list[int]:
    req = g.GenerateRequest(
        prompt_token_ids=g.TokenIds(ids=prompt),
        sampling_params=g.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )
    with open_sync_channel(address) as channel:
        return [t for r in gg.SchedulerStub(channel).Generate(req, timeout=120) for t in r.token_ids]


def test_worker_service_at_size_2_serves_and_exits_when_a_rank_dies(models, tmp_path):
    path = models["llama"]
    expected = greedy(path, 1)
    worker_args = ["--tensor-parallel-size", "2", "--kv-cache-memory", str(1 << 22), "--max-num-seqs", "4"]
    with start_mesh(
        1, model=path, worker_args=worker_args, scheduler_args=["--no-tokenizer"], log_dir=str(tmp_path)
    ) as mesh:
        assert [_generate(mesh.scheduler.address, p) for p in PROMPTS] == expected
        worker = mesh.workers[0].proc
        ranks = _children(worker.pid)
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        # Loud: the worker exits with its own status (its scheduler and supervisor see a dead worker).
        assert worker.wait(timeout=30) == EXIT_RANK_LOST


def test_ranks_exit_with_their_worker(models, tmp_path):
    port = free_port()
    cmd = [
        sys.executable, "-m", "worker_svc.service", "--model", models["llama"], "--port", str(port),
        "--tensor-parallel-size", "2", "--kv-cache-memory", str(1 << 22),
    ]  # fmt: skip
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: grpc_serving(f"127.0.0.1:{port}"), "worker ready", timeout=120)
        ranks = _children(worker.pid)
        assert len(ranks) == 1, ranks
        worker.send_signal(signal.SIGKILL)  # no cleanup of any kind runs in rank 0
        worker.wait()
        _wait(lambda: not any(_alive(r) for r in ranks), "rank 1 gone after rank 0 was killed", timeout=15)
    finally:
        if worker.poll() is None:
            worker.kill()


def _tokens(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]


def _tier_stats(llm: LLM) -> dict:
    return llm.engine.mesh.stats()["workers"]["local"]


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, 200) for _ in range(length)] for _ in range(n)]


def test_host_tier_at_size_2_gives_the_computed_tokens(models):
    # Rank 0's host tier holds whole blocks: saving gathers every rank's heads, loading hands
    # each rank its heads back (worker_svc.kv_shards).
    path, first, flood = models["llama"], _prompts(1, 2, 100), _prompts(2, 6, 100)
    reference = _tokens(LLM(path, num_kv_blocks=24, enable_prefix_caching=False), first)
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=24, kv_offload_bytes=8 << 20)
    try:
        assert _tokens(llm, first) == reference
        _tokens(llm, flood)  # evicts the first prompts' blocks from the 24-block GPU cache
        assert _tokens(llm, first) == reference
        stats = _tier_stats(llm)
        assert stats["saved_blocks"] > 0 and stats["host_hit_tokens"] >= 2 * 96
    finally:
        llm.engine.close()


def test_store_chunks_are_shared_by_workers_of_every_size(models):
    from llmesh.kv_store import open_kv_store

    path, batch = models["llama"], _prompts(3, 2, 100)
    reference = _tokens(LLM(path, enable_prefix_caching=False, **ENGINE), batch)
    store = open_kv_store("memory:64000000")
    writer = LLM(path, tensor_parallel_size=2, kv_store=store, kv_chunk_tokens=32, **ENGINE)
    try:
        assert _tokens(writer, batch) == reference
        writer.engine.flush_kv()
        assert _tier_stats(writer)["stored_chunks"] >= 2 * 3
    finally:
        writer.engine.close()
    # Size 1 loads what size 2 computed (whole blocks, size 1's layout) ...
    one = LLM(path, kv_store=store, kv_chunk_tokens=32, **ENGINE)
    assert _tokens(one, batch) == reference
    assert _tier_stats(one)["store_hit_tokens"] == 2 * 96
    one.engine.close()
    # ... and size 2 loads it too: every rank gets its heads of each loaded block.
    two = LLM(path, tensor_parallel_size=2, kv_store=store, kv_chunk_tokens=32, **ENGINE)
    try:
        assert _tokens(two, batch) == reference
        assert _tier_stats(two)["store_hit_tokens"] == 2 * 96
        assert two.engine.runner.kv_tiers.counters.store_loaded_blocks == 2 * 6
    finally:
        two.engine.close()
