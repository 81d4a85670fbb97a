"""The worker's grammar module (real llguidance, SmolLM2's tokenizer) and the sampler's bitmask."""

from __future__ import annotations

import json
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from services.model_files import load_tokenizer
from services.sampling_params import SamplingParams
from services.step import StepResult
from services.structured_outputs import StructuredOutputs
from worker_svc.pipeline import StepPipeline
from worker_svc.runner import LaunchedStep, ModelRunner
from worker_svc.sampler import Sampler, SamplingRow
from worker_svc.structured import MaskFill, StructuredOutputManager

V = 49152
EOS = 2


@pytest.fixture(scope="module")
def hf():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def manager(hf):
    # Several lexer families (a 2-core CI machine's default is one): every test here runs its
    # sequences on independent templates of their spec, as a larger host does.
    m = StructuredOutputManager(lambda: hf, V, [EOS], families=3, fill_threads=2)
    yield m
    m.close()


def allowed(mask_row: torch.Tensor) -> list[int]:
    bits = ((mask_row[torch.arange(V) >> 5] >> (torch.arange(V) & 31).to(torch.int32)) & 1).bool()
    return bits.nonzero().flatten().tolist()


def test_choice_walk_then_eos_only(manager, hf):
    g = manager.start(StructuredOutputs(choice=("yes", "no")))
    for tok in hf.encode("yes", add_special_tokens=False):
        mask = manager.bitmask([g])
        assert tok in allowed(mask[0])
        assert g.accept(tok)
    assert allowed(manager.bitmask([g])[0]) == [EOS]
    assert g.accept(EOS) and g.done
    assert allowed(manager.bitmask([g])[0]) == [EOS]  # a token planned after EOS is harmless


def test_free_rows_are_all_ones_and_refused_token_ends(manager, hf):
    g = manager.start(StructuredOutputs(regex=r"\d+"))
    mask = manager.bitmask([None, g])
    assert bool((mask[0] == -1).all())
    assert not g.accept(hf.encode("abc", add_special_tokens=False)[0])
    assert allowed(manager.bitmask([g])[0]) == [EOS]
    assert manager.bitmask([None]) is None


def test_replay_and_rollback(manager, hf):
    spec = StructuredOutputs(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    toks = hf.encode('{"a":12', add_special_tokens=False)
    fresh = manager.start(spec)
    for t in toks:
        assert fresh.accept(t)
    replayed = manager.start(spec, toks)  # a recomputed sequence: same state
    assert torch.equal(manager.bitmask([fresh]), manager.bitmask([replayed]))
    before = manager.bitmask([fresh]).clone()
    assert fresh.accept(hf.encode("}", add_special_tokens=False)[0])
    fresh.rollback(1)
    assert torch.equal(manager.bitmask([fresh]), before)
    with pytest.raises(ValueError):
        fresh.rollback(99)


def test_sampler_applies_mask_before_sampling_after_logprobs():
    s = Sampler(64, "cpu", seed=0)
    logits = torch.randn(2, 64)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 1] = -(1 << 31)  # token 63 only (bit 31: the sign bit)
    mask[1, 0] = 1 << 5  # token 5 only
    rows = [SamplingRow(SamplingParams(temperature=t, logprobs=1), [], [], [0]) for t in (0.0, 1.0)]
    ids, lps = s.sample_async(logits, rows, mask).wait()
    assert ids == [63, 5]
    raw = torch.log_softmax(logits, dim=-1)
    assert lps[0].logprob == pytest.approx(raw[0, 63].item(), abs=1e-5)  # the raw distribution's


def test_spec_key_keeps_property_order():
    a = StructuredOutputs(json={"b": 1, "a": 2})
    assert json.loads(a.json) == {"b": 1, "a": 2} and list(json.loads(a.json)) == ["b", "a"]
    assert a.key == StructuredOutputs(json=a.json).key != StructuredOutputs(regex="x").key


def test_fill_on_the_fill_thread_gives_the_same_mask(manager, hf):
    g = manager.start(StructuredOutputs(regex=r"[a-z]+\."))
    assert g.accept(hf.encode("hello", add_special_tokens=False)[0])
    fill = manager.bitmask_async([None, g, None])
    assert torch.equal(fill.result(), manager.bitmask([None, g, None]))
    assert manager.bitmask_async([None]) is None


def test_lexer_families_are_independent_templates_and_fill_each_row_in_place(manager, hf):
    """Sequences of one spec are dealt out among independently compiled templates (copies of one
    template share its lexer's lock); a batch's rows, reordered by family for the fill, land in
    their own rows and are what each row alone gives."""
    spec = StructuredOutputs(regex=r"[a-z ]+\.")
    gs = [manager.start(spec) for _ in range(6)]
    assert sorted(g.family for g in gs) == [0, 0, 1, 1, 2, 2]
    templates = {id(manager._template(spec, f)) for f in range(manager.families)}
    assert len(templates) == manager.families
    word = hf.encode(" the", add_special_tokens=False)[0]
    for g in gs[1::2]:  # a word in: "." allowed now (rows 0, 2, 4 still need one)
        assert g.accept(word)
    batch = [None, *gs[:3], None, *gs[3:]]
    mask = manager.bitmask_async(batch).result()
    for row, g in enumerate(batch):
        alone = manager.bitmask([g])
        assert bool((mask[row] == -1).all()) if alone is None else torch.equal(mask[row], alone[0])
    assert torch.equal(mask[1], mask[3]) and not torch.equal(mask[1], mask[2])


def test_a_failed_fill_is_the_steps_error_and_no_later_launch_retries_it():
    """The step thread queues a deferred sampling when it has nothing to launch: a fill that
    failed must not break the thread there, nor stay for every later launch to retry; the
    step's `finish` reports it."""
    failed: Future = Future()
    failed.set_exception(RuntimeError("fill failed"))
    launched = LaunchedStep(StepResult(step_id=1), sampling=[])
    launched.deferred = lambda mask: pytest.fail("sampled without its mask")
    launched.masks = MaskFill(torch.full((1, 1), -1, dtype=torch.int32), failed)
    runner = SimpleNamespace(_filling=launched, structured=None)
    runner.sample_deferred = lambda step: ModelRunner.sample_deferred(runner, step)  # type: ignore[arg-type]
    pipeline = StepPipeline(runner)  # type: ignore[arg-type]
    pipeline._pending = launched
    assert pipeline.pending_event is None
    assert runner._filling is None  # the next launch queues no retry first
    with pytest.raises(RuntimeError, match="fill failed"):
        runner.sample_deferred(launched)  # as `finish` does
