"""Tensor parallelism on two GPUs (NCCL, Triton attention, CUDA graphs, async scheduling).

Skipped unless two CUDA devices are visible. A small Llama-shaped model with random weights
(`load_format="dummy"`: every size draws the size-1 weights and keeps its slices) generates
greedy tokens at size 2 and at size 1, in fp32 so that the all-reduce's other summation order
moves logits by ~1e-6 and the tokens must be equal, through batched decodes that replay the
captured graphs (with their all-reduces inside) and mixed prefill steps.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmesh import LLM, SamplingParams

pytestmark = pytest.mark.gpu

SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 4099,  # odd: the vocabulary is padded across the ranks
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(autouse=True)
def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")


def _engine(path: str, size: int, **kw) -> LLM:
    return LLM(
        path,
        tensor_parallel_size=size,
        load_format="dummy",
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=16,
        **kw,
    )


def _free_memory() -> None:
    """After `llm.engine.close(); del llm`: the next engine sizes its KV cache from what is free."""
    gc.collect()
    torch.cuda.empty_cache()


def _greedy(path: str, size: int, **kw) -> list[list[int]]:
    llm = _engine(path, size, gpu_memory_utilization=0.5, **kw)
    try:
        prompts = [
            {"prompt_token_ids": list(range(10 + 3 * i, 10 + 3 * i + n))}
            for i, n in enumerate((5, 37, 200, 9))
        ]
        sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        assert llm.engine.runner.executor.graphs is not None  # decodes replay graphs with all-reduces inside
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        llm.engine.close()
        del llm
        _free_memory()


@pytest.mark.parametrize("all_reduce", ["auto", "nccl"])
def test_two_gpus_greedy_equals_one(tmp_path, all_reduce):
    """auto: decode steps all-reduce peer to peer (symmetric memory), prefills through NCCL."""
    (tmp_path / "config.json").write_text(json.dumps(SHAPE))
    two = _greedy(str(tmp_path), 2, tp_all_reduce=all_reduce)
    assert two == _greedy(str(tmp_path), 1)


def test_p2p_all_reduce_equals_nccl():
    """The one-shot peer-to-peer all-reduce against its twin, NCCL: equal sums on both ranks,
    also inside CUDA graphs (benchmarks/tp_all_reduce.py exits 1 on a mismatch)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "tp_all_reduce.py"
    for dtype in ("float32", "bfloat16"):
        done = subprocess.run(
            [sys.executable, str(script), "--dtype", dtype, "--kib", "16,1024,16384"], timeout=240
        )
        assert done.returncode == 0, dtype


def test_two_gpus_host_tier_gives_the_computed_tokens(tmp_path):
    """Saves gather both GPUs' heads into pinned memory on the copy stream; loads broadcast them."""
    (tmp_path / "config.json").write_text(json.dumps(SHAPE))
    prompts = [{"prompt_token_ids": list(range(30 + 7 * i, 30 + 7 * i + 100))} for i in range(2)]
    flood = [{"prompt_token_ids": list(range(1000 + 7 * i, 1000 + 7 * i + 100))} for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = []
    for size in (1, 2):
        llm = _engine(str(tmp_path), size, num_kv_blocks=24, kv_offload_bytes=64 << 20)
        try:
            first = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            llm.generate(flood, sp, use_tqdm=False)  # evicts the first prompts' blocks
            again = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            assert again == first
            assert llm.engine.mesh.stats()["workers"]["local"]["host_hit_tokens"] >= 2 * 96
            outs.append(first)
        finally:
            llm.engine.close()
            del llm
            _free_memory()
    assert outs[0] == outs[1]
