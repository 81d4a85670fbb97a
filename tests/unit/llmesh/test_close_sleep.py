"""`LLM.close()`, `with LLM(...)`, `del llm`, and `sleep` / `wake_up`, on SmolLM2 (fp32, CPU).

Freed means nothing holds the weights or the KV cache any more: weak references to those
tensors die, and no thread of the engine is left running (tests/gpu/test_llm_close.py checks
the device's allocated bytes on a GPU).
"""

from __future__ import annotations

import threading
import weakref

import pytest

from llmesh import LLM, SamplingParams

ENGINE = dict(max_model_len=256, num_kv_blocks=64, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# Longer than a 16-token block: a prefix-cache hit on a discarded KV cache would change the output.
PROMPT = "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz"


def _engine_threads() -> set[str]:
    names = ("llmesh-", "grammar")
    return {t.name for t in threading.enumerate() if t.name.startswith(names)}


def _greedy(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _device_tensors(llm: LLM) -> list[weakref.ref]:
    runner = llm.engine.runner
    return [weakref.ref(t) for t in (*list(runner.model.parameters())[:3], runner.kv_caches[0])]


def test_sleep_wake_up_then_close_by_with(smollm2: str) -> None:
    before = _engine_threads()
    with LLM(smollm2, **ENGINE) as llm:
        expected = _greedy(llm)
        weight = next(llm.engine.runner.model.parameters())
        kv = weakref.ref(llm.engine.runner.kv_caches[0])

        llm.sleep(level=1)
        assert llm.is_sleeping and kv() is None
        with pytest.raises(RuntimeError, match="asleep"):
            llm.generate([PROMPT], GREEDY, use_tqdm=False)
        llm.wake_up()
        assert not llm.is_sleeping
        assert _greedy(llm) == expected  # the prefix cache was forgotten with the KV cache

        llm.sleep(level=2)
        assert weight.numel() == 0  # discarded, not offloaded
        llm.wake_up(tags=["weights"])  # reloaded from the checkpoint into the same parameter
        assert weight.numel() > 0 and llm.is_sleeping
        llm.wake_up(tags=["kv_cache"])
        assert _greedy(llm) == expected
        with pytest.raises(ValueError, match="sleep level"):
            llm.sleep(level=3)
        refs = _device_tensors(llm)
        del weight
    assert llm.engine.closed
    assert all(r() is None for r in refs)  # nothing holds the weights or the KV cache
    assert _engine_threads() <= before
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="closed"):
        llm.sleep()


def test_del_frees_at_once(smollm2: str) -> None:
    before = _engine_threads()
    llm = LLM(smollm2, **ENGINE)
    assert _greedy(llm)
    refs = _device_tensors(llm)
    del llm  # no gc.collect(): the engine's finalizer runs as the last reference goes
    assert all(r() is None for r in refs)
    assert _engine_threads() <= before
