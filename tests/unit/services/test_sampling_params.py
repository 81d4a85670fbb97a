"""SamplingParams validation: every bad value names its param; good values pass and normalise."""

from __future__ import annotations

import math

import pytest

from services.sampling_params import SamplingParams, SamplingParamsError

BAD = [
    ("n", 0),
    ("n", 129),
    ("n", 1.0),
    ("temperature", -0.1),
    ("temperature", 2.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -math.inf),
    ("temperature", "a"),
    ("temperature", True),
    ("temperature", None),
    ("temperature", 10**400),  # beyond float range: must not escape as OverflowError
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", 1.1),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", -1.0),  # only the int -1 means "all"
    ("top_k", True),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("repetition_penalty", 0),
    ("repetition_penalty", 2.5),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.1),
    ("presence_penalty", -2.1),
    ("frequency_penalty", 2.1),
    ("frequency_penalty", -2.1),
    ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("seed", 1.5),
    ("seed", "1"),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 1.5),
    ("min_tokens", -1),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, -5]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", 7),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [3]),
    ("stop", 3),
    ("logprobs", 21),
    ("logprobs", -1),
    ("logprobs", True),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("ignore_eos", None),
    ("max_logprobs", -1),
]


@pytest.mark.parametrize(("param", "value"), BAD, ids=[f"{p}={v!r}" for p, v in BAD])
def test_bad_value_raises_naming_param(param: str, value: object) -> None:
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(**{param: value})
    assert exc.value.param == param
    assert str(exc.value).startswith(f"{param}:")
    assert isinstance(exc.value, ValueError)  # callers that only know ValueError still catch it


def test_min_tokens_above_max_tokens_names_min_tokens() -> None:
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert exc.value.param == "min_tokens"
    # No max_tokens (up to the context length): any min_tokens is accepted here.
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


GOOD = [
    {},
    {"n": 1},
    {"n": 128},
    {"temperature": 0},
    {"temperature": 0.0},
    {"temperature": 2.0},
    {"temperature": 1},
    {"top_p": 1.0},
    {"top_p": 1e-6},
    {"top_k": 0},
    {"top_k": 1},
    {"top_k": 100_000},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"repetition_penalty": 1e-3},
    {"repetition_penalty": 2.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"presence_penalty": 2, "frequency_penalty": -2},
    {"seed": 0},
    {"seed": 2**63 - 1},
    {"seed": -(2**63)},
    {"max_tokens": 1},
    {"max_tokens": None},
    {"min_tokens": 16, "max_tokens": 16},
    {"stop_token_ids": [0, 2, 128000]},
    {"stop_token_ids": (1, 2)},
    {"stop": ["\n\n", "END"]},
    {"stop": None},
    {"logprobs": 0},
    {"logprobs": 20},
    {"logprobs": None},
    {"logprobs": 50, "max_logprobs": 50},
    {"ignore_eos": True},
]


@pytest.mark.parametrize("kwargs", GOOD, ids=[repr(g) for g in GOOD])
def test_good_values_pass(kwargs: dict) -> None:
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name not in ("stop", "stop_token_ids"):
            assert getattr(p, name) == value


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.seed is None and p.logprobs is None and not p.ignore_eos
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.greedy


def test_top_k_minus_one_normalises_to_zero() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_stop_string_normalises_to_list() -> None:
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_lists_are_copied() -> None:
    # Two requests built from one list must not share (and mutate) it.
    ids = [5]
    p = SamplingParams(stop_token_ids=ids)
    ids.append(6)
    assert p.stop_token_ids == [5]


def test_greedy() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_validate_catches_mutation() -> None:
    p = SamplingParams()
    p.temperature = 3.0
    with pytest.raises(SamplingParamsError) as exc:
        p.validate()
    assert exc.value.param == "temperature"


def test_detokenize_is_a_boolean_and_stop_strings_need_it():
    assert SamplingParams(detokenize=False).detokenize is False
    with pytest.raises(SamplingParamsError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["\n"])
    with pytest.raises(SamplingParamsError, match="detokenize"):
        SamplingParams(detokenize=1)  # type: ignore[arg-type]
