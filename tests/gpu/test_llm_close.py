"""Engines that give their GPU memory back: two Llama-3.1-8B-shaped engines in a row, each taking
most of the device, the first deleted (`del llm`, as issue 31 found a second one dying of CUDA
OOM); one closed by `with`; `sleep` / `wake_up` at both levels bring the same greedy tokens.

Dummy bf16 weights (the same at every build: they are drawn from fixed seeds), the KV cache
sized by the default gpu_memory_utilization. Run with -s for the timings.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

from benchmarks.gpu import SHAPES, write_config
from llmesh import LLM, SamplingParams

pytestmark = pytest.mark.gpu

ENGINE = dict(load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=16)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1 + (i * 37 + j * 11) % 30000 for j in range(40 + 9 * i)]} for i in range(4)]
NEAR_ZERO = 512 << 20  # bytes: what may stay allocated (none of weights, KV, graphs is this small)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _build(path: str) -> LLM:
    t = time.perf_counter()
    llm = LLM(path, **ENGINE)
    print(f"built in {time.perf_counter() - t:.1f} s, allocated {_gib(torch.cuda.memory_allocated())}")
    return llm


@pytest.fixture(scope="module")
def model_8b(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_config(str(tmp_path_factory.mktemp("close")), "llama-3.1-8b", SHAPES["llama-3.1-8b"])


def test_two_engines_in_a_row_after_del(model_8b: str) -> None:
    llm = _build(model_8b)
    held = torch.cuda.memory_allocated()
    assert held > 0.6 * torch.cuda.get_device_properties(0).total_memory  # a second could not fit beside it
    expected = _greedy(llm)
    t = time.perf_counter()
    del llm  # the sequence: del, gc.collect(), empty_cache()
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated()
    print(f"del: {time.perf_counter() - t:.2f} s, allocated {_gib(held)} -> {_gib(left)}")
    assert left < NEAR_ZERO
    llm = _build(model_8b)  # died of CUDA OOM before
    assert _greedy(llm) == expected
    llm.close()
    assert torch.cuda.memory_allocated() < NEAR_ZERO


def test_with_and_sleep_wake_up(model_8b: str) -> None:
    with _build(model_8b) as llm:
        held = torch.cuda.memory_allocated()
        expected = _greedy(llm)
        for level in (1, 2):
            t = time.perf_counter()
            llm.sleep(level=level)
            slept = time.perf_counter() - t
            asleep = torch.cuda.memory_allocated()
            t = time.perf_counter()
            llm.wake_up()
            woke = time.perf_counter() - t
            print(
                f"sleep level {level}: {slept:.2f} s, allocated {_gib(held)} -> {_gib(asleep)}; "
                f"wake_up {woke:.2f} s -> {_gib(torch.cuda.memory_allocated())}"
            )
            assert asleep < NEAR_ZERO
            assert _greedy(llm) == expected
    assert torch.cuda.memory_allocated() < NEAR_ZERO
