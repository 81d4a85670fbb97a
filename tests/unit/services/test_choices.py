"""services/choices.py: fan-out, length checks and per-choice output, and the scheduler's
`Generate` fan-out over a real gRPC server on loopback (a stand-in mesh behind it)."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import grpc
import pytest

from services.gen_protos import ensure_stubs

ensure_stubs()  # before the imports below: they load the generated llmesh.v1 modules

from llmesh.v1 import generation_pb2 as g  # noqa: E402
from llmesh.v1 import generation_pb2_grpc as gg  # noqa: E402
from scheduler_svc.planner import RequestRejected  # noqa: E402
from scheduler_svc.request import FinishReason, RequestDelta  # noqa: E402
from scheduler_svc.servicer import ModelCard, SchedulerServicer  # noqa: E402
from services.choices import (  # noqa: E402
    ChoiceState,
    ContextLengthError,
    FanOut,
    child_id,
    child_seed,
    fit_max_tokens,
    make_detokenizer,
)
from services.detokenizer import IncrementalDetokenizer  # noqa: E402
from services.limits import RequestLimits  # noqa: E402
from services.sampling_params import SamplingParams  # noqa: E402
from services.step import WorkerInfo  # noqa: E402

INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def hf():
    from services.model_files import load_tokenizer

    return load_tokenizer(None)


# ----- fan-out ---------------------------------------------------------------------------------


def test_child_seeds_wrap_in_int64_and_ids():
    assert child_seed(None, 3) is None
    assert child_seed(10, 2) == 12
    assert child_seed(INT64_MAX, 1) == -(2**63)
    assert child_seed(-(2**63), 0) == -(2**63)
    assert child_id("abc", 2) == "abc-2"


def test_fanout_plans_every_child_before_any_submission():
    one = SamplingParams(seed=5, stop=["x"])
    plan = FanOut.plan("r", one)
    assert plan.ids == ["r-0"] and plan.params == [one]
    many = FanOut.plan("r", SamplingParams(n=3, seed=INT64_MAX, stop=["x"]), keep_stop=False)
    assert plan.ids == ["r-0"] and len(many) == 3
    assert [p.seed for p in many.params] == [INT64_MAX, -(2**63), -(2**63) + 1]
    assert all(p.n == 1 and p.stop == [] for p in many.params)


def test_fanout_submit_is_all_or_nothing():
    plan = FanOut.plan("r", SamplingParams(n=3))
    submitted, aborted = [], []

    def submit(cid, _sp):
        if cid == "r-2":
            raise RuntimeError("boom")
        submitted.append(cid)

    with pytest.raises(RuntimeError, match="boom"):
        plan.submit(submit, aborted.append)
    assert submitted == aborted == ["r-0", "r-1"]


def test_fit_max_tokens():
    assert fit_max_tokens(10, None, 64) == 54
    assert fit_max_tokens(10, 54, 64) == 54
    assert fit_max_tokens(10, 99, 64, cap=True) == 54
    with pytest.raises(ContextLengthError, match="max_tokens") as e:
        fit_max_tokens(10, 55, 64)
    assert e.value.param == "max_tokens"
    with pytest.raises(ContextLengthError, match="max_model_len 64") as e:
        fit_max_tokens(64, 1, 64, cap=True)
    assert e.value.param == "prompt"


# ----- per-choice output -----------------------------------------------------------------------


def test_stream_detokenizer_equals_the_window_method(hf):
    rng = random.Random(0)
    texts = ["Ça coûte 5€ — 日本語のテキスト 😀👍🏽 naïve café", "<|im_start|>user\nhi<|im_end|>\n x"]
    for trial in range(300):
        if trial % 2:
            ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 30))]  # broken UTF-8 too
        else:
            ids = hf.encode(rng.choice(texts), add_special_tokens=False)[rng.randrange(4) :]
        for skip in (True, False):
            a, b = IncrementalDetokenizer(hf, skip), make_detokenizer(hf, skip)
            assert type(b) is not IncrementalDetokenizer
            k = 0
            while k < len(ids):
                m = rng.randrange(1, 4)
                assert a.push(ids[k : k + m]) == b.push(ids[k : k + m])
                k += m
            assert a.flush() == b.flush()
            assert a.text == b.text


def test_stop_string_cuts_tokens_text_and_cancels(hf):
    ids = hf.encode(" one two three four five", add_special_tokens=False)
    state = ChoiceState(hf, stop=[" three"], keep_token_ids=True)
    up = state.absorb(ids)  # everything in one batch, upstream still running
    assert state.finished and state.finish_reason == "stop" and state.stop_reason == " three"
    assert up.cancel and up.text == " one two" and state.text == " one two"
    assert up.num_tokens == state.num_tokens < len(ids)
    assert hf.decode(state.token_ids).endswith("three")
    assert state.absorb(ids).num_tokens == 0  # finished: takes nothing more


def test_text_once_at_the_end_or_none(hf):
    ids = hf.encode(" Paris is nice", add_special_tokens=False) + [2]
    state = ChoiceState(hf, stop_token_ids=[2], stream_text=False, keep_token_ids=True)
    assert state.absorb(ids[:2]).text == "" and state.text == ""
    state.absorb(ids[2:], "stop")
    assert state.text == " Paris is nice" and state.stop_reason == 2
    ids_only = ChoiceState(None)
    ids_only.absorb(ids, "length")
    assert ids_only.text == "" and ids_only.num_tokens == len(ids) and ids_only.stop_reason is None
    with pytest.raises(ValueError, match="tokenizer"):
        ChoiceState(None, stop=["x"])


def test_held_back_text_is_released_at_the_end(hf):
    ids = hf.encode(" a b c d", add_special_tokens=False)
    state = ChoiceState(hf, stop=[" d e"])
    out = "".join(state.absorb([t]).text for t in ids[:-1])
    out += state.absorb(ids[-1:], "length").text
    assert out == " a b c d" and state.finish_reason == "length"


# ----- the scheduler's Generate: fan-out over a real gRPC server --------------------------------


class FakeMesh:
    """What SchedulerServicer uses of a Mesh; finishes each request at once with two tokens.

    `fail_on` maps a child's position in submission order to the exception its submit raises.
    """

    def __init__(self, fail_on: dict[int, Exception] | None = None) -> None:
        self.model_info = WorkerInfo("m", b"f", 16, 100, 64, 1000, [2])
        self.workers = {"w": SimpleNamespace(connected=True)}
        self.fail_on = fail_on or {}
        self.submitted: list[tuple[str, SamplingParams]] = []
        self.aborted: list[str] = []

    def submit(self, request_id, prompt, params, priority, queue, group="", cache_salt="", **lora):
        exc = self.fail_on.get(len(self.submitted))
        if exc is not None:
            raise exc
        self.submitted.append((request_id, params))
        queue.put_nowait(RequestDelta(request_id, [5, 6], [None, None], FinishReason.LENGTH, len(prompt), 2))

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


async def _generate(mesh: FakeMesh, **kw) -> list[g.GenerateResponse]:
    server = grpc.aio.server()
    gg.add_SchedulerServicer_to_server(SchedulerServicer(mesh, ModelCard("m", "m"), RequestLimits()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            req = g.GenerateRequest(prompt_token_ids=g.TokenIds(ids=[7, 8, 9]), **kw)
            return [r async for r in gg.SchedulerStub(channel).Generate(req, timeout=10)]
    finally:
        await server.stop(0)


def test_grpc_fanout_with_the_largest_seed_runs_every_choice():
    """The verified bug: n=2, seed=2**63-1 failed with UNKNOWN after choice 0 was submitted."""
    mesh = FakeMesh()
    sp = g.SamplingParams(n=2, seed=INT64_MAX, temperature=1.0, max_tokens=2)
    resps = asyncio.run(_generate(mesh, sampling_params=sp))
    assert sorted(r.index for r in resps) == [0, 1]
    assert [p.seed for _, p in mesh.submitted] == [INT64_MAX, -(2**63)]
    assert resps[-1].usage.completion_tokens == 4


@pytest.mark.parametrize(
    "exc, code",
    [
        (RequestRejected("too long for the KV cache"), grpc.StatusCode.INVALID_ARGUMENT),
        (RuntimeError("a bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_a_failure_mid_fanout_aborts_every_submitted_choice(exc, code):
    mesh = FakeMesh(fail_on={2: exc})
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_generate(mesh, sampling_params=g.SamplingParams(n=3, max_tokens=2)))
    assert e.value.code() == code
    submitted = [cid for cid, _ in mesh.submitted]
    assert len(submitted) == 2 and set(submitted) <= set(mesh.aborted)


def test_invalid_fanouts_are_refused_before_anything_is_submitted():
    for sp in (g.SamplingParams(n=17), g.SamplingParams(n=2, max_tokens=62)):  # > max_n; > context
        mesh = FakeMesh()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(_generate(mesh, sampling_params=sp))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert mesh.submitted == []
