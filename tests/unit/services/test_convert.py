"""The gRPC edge conversions are lossless: dataclass -> proto -> bytes -> proto -> dataclass."""

from __future__ import annotations

import dataclasses
import math
import random
import struct

import pytest

from services.gen_protos import ensure_stubs

ensure_stubs()  # before the imports below: they load the generated llmesh.v1 modules

from llmesh.v1 import generation_pb2, worker_pb2  # noqa: E402
from services import convert  # noqa: E402
from services.sampling_params import SamplingParams, SamplingParamsError  # noqa: E402
from services.step import (  # noqa: E402
    NewSequence,
    ScheduledSequence,
    StepPlan,
    StepResult,
    TokenLogprobs,
    WorkerInfo,
)
from services.structured_outputs import StructuredOutputs  # noqa: E402


def f32(x: float) -> float:
    """x rounded to float32: logprobs travel as float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def wire(msg):
    """Through the bytes, as a peer would see it."""
    return type(msg).FromString(msg.SerializeToString())


# -- sampling params ---------------------------------------------------------------

FULL_PARAMS = SamplingParams(
    n=3,
    temperature=0.7,
    top_p=0.95,
    top_k=40,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=-0.5,
    frequency_penalty=1.25,
    seed=-(2**63),
    max_tokens=123,
    min_tokens=5,
    stop_token_ids=[2, 0, 151643],
    stop=["\n\n", "END", "ünï"],
    ignore_eos=True,
    logprobs=5,
    max_logprobs=7,
)


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(),
        FULL_PARAMS,
        SamplingParams(temperature=0.0, max_tokens=None, seed=2**63 - 1, logprobs=0),
        SamplingParams(temperature=0.1 + 0.2, top_p=1e-300),  # doubles: no float32 rounding
        SamplingParams(max_tokens=1, min_tokens=1, max_logprobs=0, logprobs=0),
        SamplingParams(structured_outputs=StructuredOutputs(json={"type": "object", "required": ["a"]})),
        SamplingParams(structured_outputs=StructuredOutputs(json_object=True)),
        SamplingParams(structured_outputs=StructuredOutputs(regex=r"\d{3}-ünï")),
        SamplingParams(structured_outputs=StructuredOutputs(choice=("yes", "no", "ünï"))),
        SamplingParams(structured_outputs=StructuredOutputs(grammar='start: "a"+')),
    ],
    ids=[
        "defaults",
        "full",
        "greedy-unbounded",
        "awkward-floats",
        "edges",
        "json-schema",
        "json-object",
        "regex",
        "choice",
        "grammar",
    ],
)
def test_sampling_params_round_trip(sp: SamplingParams) -> None:
    back = convert.sampling_params_from_proto(wire(convert.sampling_params_to_proto(sp)))
    assert back == sp
    # Integer fields come back as ints (not floats that merely compare equal).
    for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "max_logprobs"):
        assert type(getattr(back, name)) is type(getattr(sp, name)), name


def test_every_sampling_param_has_a_proto_field() -> None:
    # A field added to the dataclass must be added to the contract (and to convert).
    proto_fields = set(generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    assert {f.name for f in dataclasses.fields(SamplingParams)} == proto_fields


def test_unset_proto_fields_mean_engine_defaults() -> None:
    sp = convert.sampling_params_from_proto(generation_pb2.SamplingParams())
    defaults = SamplingParams()
    # max_tokens unset = up to the context length on the wire (not the offline default of 16).
    assert sp == dataclasses.replace(defaults, max_tokens=None)
    assert sp.seed is None and sp.logprobs is None and sp.temperature == 1.0 and sp.top_p == 1.0


def test_none_fields_stay_unset_on_the_wire() -> None:
    msg = convert.sampling_params_to_proto(SamplingParams(max_tokens=None))
    assert not msg.HasField("max_tokens") and not msg.HasField("seed") and not msg.HasField("logprobs")
    msg = convert.sampling_params_to_proto(SamplingParams(temperature=0.0, seed=0, logprobs=0))
    assert msg.HasField("temperature") and msg.temperature == 0.0  # 0 = greedy, not "unset"
    assert msg.HasField("seed") and msg.HasField("logprobs")


def test_top_k_minus_one_from_a_client_means_all() -> None:
    assert convert.sampling_params_from_proto(generation_pb2.SamplingParams(top_k=-1)).top_k == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 3.0), ("top_p", 0.0), ("n", 0), ("logprobs", 21), ("min_p", math.nan), ("top_k", -2)],
)
def test_invalid_proto_sampling_params_name_the_param(field: str, value: object) -> None:
    with pytest.raises(SamplingParamsError) as err:
        convert.sampling_params_from_proto(generation_pb2.SamplingParams(**{field: value}))
    assert err.value.param == field


# -- step plan ---------------------------------------------------------------------


def _plan() -> StepPlan:
    return StepPlan(
        step_id=2**64 - 1,
        new_seqs=[
            NewSequence(
                seq_id="req-1/0",
                token_ids=[1, 2, 3, 4, 5, 151_000],
                num_prompt_tokens=4,
                block_ids=[7, 0],
                num_computed_tokens=0,
                num_new_tokens=6,
                sampling_params=FULL_PARAMS,
            ),
            NewSequence(
                seq_id="req-2/0",
                token_ids=list(range(40)),
                num_prompt_tokens=40,
                block_ids=[1, 2, 3],
                num_computed_tokens=32,
                num_new_tokens=8,
                sampling_params=SamplingParams(temperature=0.0),
                max_draft_tokens=4,
            ),
        ],
        scheduled=[
            ScheduledSequence("a", 1),
            ScheduledSequence("b", 1, [9], max_draft_tokens=3),
            ScheduledSequence("c", 512, [10, 11, 12]),
            ScheduledSequence("d", 5, []),  # a decode verifying 4 drafts
        ],
        finished_ids=["x", "y"],
        preempted_ids=["z"],
    )


@pytest.mark.parametrize(
    "plan",
    [StepPlan(step_id=0), _plan(), StepPlan(step_id=5, finished_ids=["only-drops"])],
    ids=["empty", "full", "drops-only"],
)
def test_step_plan_round_trip(plan: StepPlan) -> None:
    assert convert.step_plan_from_proto(wire(convert.step_plan_to_proto(plan))) == plan


def test_step_plan_random_round_trips() -> None:
    rng = random.Random(0)
    for step in range(50):
        scheduled = [
            ScheduledSequence(
                f"s{i}", rng.randint(1, 64), [rng.randrange(2**31) for _ in range(rng.randint(0, 3))]
            )
            for i in range(rng.randint(0, 20))
        ]
        plan = StepPlan(
            step_id=step, scheduled=scheduled, finished_ids=[f"f{i}" for i in range(rng.randint(0, 3))]
        )
        assert convert.step_plan_from_proto(wire(convert.step_plan_to_proto(plan))) == plan


def test_scheduled_sequences_travel_as_packed_columns() -> None:
    msg = convert.step_plan_to_proto(_plan())
    assert list(msg.scheduled.seq_ids) == ["a", "b", "c", "d"]
    assert list(msg.scheduled.num_new_block_ids) == [0, 1, 3, 0]
    assert list(msg.scheduled.new_block_ids) == [9, 10, 11, 12]
    assert list(msg.scheduled.max_draft_tokens) == [0, 3, 0, 0]
    plain = StepPlan(step_id=1, scheduled=[ScheduledSequence("a", 1), ScheduledSequence("b", 1)])
    assert not convert.step_plan_to_proto(plain).scheduled.max_draft_tokens  # no column without drafts


def test_malformed_scheduled_columns_are_rejected() -> None:
    msg = convert.step_plan_to_proto(_plan())
    msg.scheduled.new_block_ids.append(99)  # one block id too many
    with pytest.raises(ValueError, match="num_new_block_ids"):
        convert.step_plan_from_proto(msg)
    msg = convert.step_plan_to_proto(_plan())
    msg.scheduled.num_new_tokens.append(1)
    with pytest.raises(ValueError, match="differ in length"):
        convert.step_plan_from_proto(msg)


# -- step result -------------------------------------------------------------------


def _result() -> StepResult:
    return StepResult(
        step_id=42,
        seq_ids=["a", "b", "c", "d"],
        token_ids=[11, 22, 33, 44],
        logprobs=[
            None,
            TokenLogprobs(token_id=22, logprob=f32(-0.1), rank=1),  # logprobs=0: sampled token only
            TokenLogprobs(
                token_id=33,
                logprob=f32(-3.7),
                rank=4,
                top_token_ids=[5, 6, 7],
                top_logprobs=[f32(-0.2), f32(-1.5), -math.inf],
            ),
            TokenLogprobs(token_id=44, logprob=0.0, rank=1, top_token_ids=[44], top_logprobs=[0.0]),
        ],
    )


@pytest.mark.parametrize(
    "result",
    [
        StepResult(step_id=0),
        StepResult(step_id=1, seq_ids=["a", "b"], token_ids=[5, 6], logprobs=[None, None]),
        _result(),
        StepResult(
            step_id=3,
            seq_ids=["a", "a", "a", "b"],  # "a" accepted two drafts, then sampled its third token
            token_ids=[5, 6, 7, 8],
            logprobs=[None] * 4,
            draft_seq_ids=["a", "b"],
            num_draft_tokens=[4, 1],
        ),
    ],
    ids=["empty", "no-logprobs", "mixed-logprobs", "speculative"],
)
def test_step_result_round_trip(result: StepResult) -> None:
    assert convert.step_result_from_proto(wire(convert.step_result_to_proto(result))) == result


def test_step_result_without_logprobs_list_decodes_as_all_none() -> None:
    result = StepResult(step_id=1, seq_ids=["a", "b"], token_ids=[5, 6])
    back = convert.step_result_from_proto(wire(convert.step_result_to_proto(result)))
    assert back.logprobs == [None, None]


def test_logprobs_are_packed_float32_columns() -> None:
    msg = convert.step_result_to_proto(_result())
    lp = msg.logprobs
    assert list(lp.token_index) == [1, 2, 3]
    assert list(lp.num_top) == [0, 3, 1]
    assert list(lp.top_token_ids) == [5, 6, 7, 44]
    # float32 on the wire: a float64-only value comes back rounded.
    back = convert.logprobs_from_proto(
        wire(convert.logprobs_to_proto([TokenLogprobs(token_id=1, logprob=-0.1, rank=1)], [1])), [1]
    )
    assert back[0] is not None and back[0].logprob == f32(-0.1) != -0.1


def test_logprobs_for_another_token_are_rejected() -> None:
    bad = StepResult(
        step_id=1, seq_ids=["a"], token_ids=[5], logprobs=[TokenLogprobs(token_id=6, logprob=0.0, rank=1)]
    )
    with pytest.raises(ValueError, match="sampled"):
        convert.step_result_to_proto(bad)


def test_malformed_logprobs_are_rejected() -> None:
    msg = convert.step_result_to_proto(_result())
    msg.logprobs.top_token_ids.append(1)
    with pytest.raises(ValueError, match="num_top"):
        convert.step_result_from_proto(msg)
    msg = convert.step_result_to_proto(_result())
    msg.logprobs.token_index[0] = 9
    with pytest.raises(ValueError, match="out of range"):
        convert.step_result_from_proto(msg)


def test_generate_response_logprobs_use_the_same_packing() -> None:
    entries = _result().logprobs
    token_ids = _result().token_ids
    resp = generation_pb2.GenerateResponse(
        request_id="r", token_ids=token_ids, logprobs=convert.logprobs_to_proto(entries, token_ids)
    )
    assert convert.logprobs_from_proto(wire(resp).logprobs, list(resp.token_ids)) == entries


def test_worker_messages_exist_for_the_contract() -> None:
    # The dataclasses and the worker contract mirror each other field for field.
    assert set(worker_pb2.NewSequence.DESCRIPTOR.fields_by_name) == {
        f.name for f in dataclasses.fields(NewSequence)
    }
    assert set(worker_pb2.StepPlan.DESCRIPTOR.fields_by_name) == {
        f.name for f in dataclasses.fields(StepPlan)
    }
    assert set(worker_pb2.StepResult.DESCRIPTOR.fields_by_name) == {
        f.name for f in dataclasses.fields(StepResult)
    }


# -- worker info -------------------------------------------------------------------


def test_worker_info_round_trip() -> None:
    info = WorkerInfo(
        model_name="SmolLM2-135M-Instruct",
        fingerprint=bytes(range(32)),
        block_size=16,
        num_kv_blocks=4096,
        max_model_len=8192,
        vocab_size=49152,
        eos_token_ids=[0, 2],
        worker_id="worker-0",
        max_num_seqs=128,
        instance_id="boot-1",
    )
    msg = wire(convert.worker_info_to_proto(info, device="cpu"))
    assert msg.instance_id == "boot-1" and msg.device == "cpu"
    assert convert.worker_info_from_proto(msg) == info
    # Every dataclass field has its proto field: nothing the scheduler plans with is lost.
    assert {f.name for f in dataclasses.fields(WorkerInfo)} <= set(
        worker_pb2.WorkerInfo.DESCRIPTOR.fields_by_name
    )
