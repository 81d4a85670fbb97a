"""Sampling parameters, validated on construction with OpenAI/vLLM-style ranges."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.structured_outputs import StructuredOutputs, StructuredOutputsError

_SEED_LIMIT = 2**63
# How a pooling request (embeddings) pools the prompt's final hidden states; "default" = the
# model's (its sentence-transformers pooling config or the worker's --pooling-type, else last).
POOLING_TYPES = ("default", "last", "mean", "cls")


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names it (OpenAI error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _check_number(name: str, value: float, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingParamsError(name, f"must be a number, got {type(value).__name__}")
    # ints are always finite (and math.isfinite overflows on ints beyond float range).
    if isinstance(value, float) and not math.isfinite(value):
        raise SamplingParamsError(name, f"must be finite, got {value}")
    too_low = value <= lo if lo_open else value < lo
    if too_low or value > hi:
        left = "(" if lo_open else "["
        raise SamplingParamsError(name, f"must be in {left}{lo}, {hi}], got {value}")


def _check_int(name: str, value: int, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"must be an integer, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise SamplingParamsError(name, f"must be {bound}, got {value}")


def _as_list(name: str, value: object) -> list:
    # A bare int, a str of ids or a dict is a caller mistake, not a sequence of values.
    if not isinstance(value, list | tuple):
        raise SamplingParamsError(name, f"must be a list, got {type(value).__name__}")
    return list(value)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # multiplicative, over prompt + output tokens (HF/vLLM style)
    presence_penalty: float = 0.0  # additive, over output tokens (OpenAI style)
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # matched on detokenized text (offline + gateway)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = no logprobs; k >= 0 = sampled token + top-k
    max_logprobs: int = 20
    # vLLM's prompt_logprobs: None = none; k >= 0 = each prompt token's logprob (after the
    # first) + its top-k alternatives. The prompt is computed in full (no prefix-cache hits).
    prompt_logprobs: int | None = None
    # A pooling request (vLLM's embed/encode): the prompt is prefilled and its final hidden
    # states pooled (POOLING_TYPES); nothing is sampled. None = generate.
    pooling: str | None = None
    # False: token ids only, no text (saves two decodes per token where nothing reads text).
    detokenize: bool = True
    # Constrain the output to a JSON schema / regex / choice / grammar (checked here, applied
    # as a token mask by the worker). None = free text.
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # Only the int -1 means "all tokens"; -1.0 or True must still fail validation.
        if type(self.top_k) is int and self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        self.stop = _as_list("stop", self.stop)
        self.validate()

    def validate(self) -> None:
        _check_int("n", self.n, 1, 128)
        _check_number("temperature", self.temperature, 0.0, 2.0)
        _check_number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, 0)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -_SEED_LIMIT, _SEED_LIMIT - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", "must be non-empty strings")
        _check_int("max_logprobs", self.max_logprobs, 0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, self.max_logprobs)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, self.max_logprobs)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos", "must be a boolean")
        if not isinstance(self.detokenize, bool):
            raise SamplingParamsError("detokenize", "must be a boolean")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise SamplingParamsError("structured_outputs", "must be a StructuredOutputs")
            try:
                self.structured_outputs.validate()
            except StructuredOutputsError as e:
                param = "structured_outputs"
                if e.param != param:
                    param += "." + e.param
                raise SamplingParamsError(param, str(e).split(": ", 1)[-1]) from None
        if self.pooling is not None:
            self._check_pooling()
        if self.stop and not self.detokenize:
            raise SamplingParamsError(
                "detokenize", "stop strings are matched on text: they need detokenize=True"
            )

    def _check_pooling(self) -> None:
        if self.pooling not in POOLING_TYPES:
            choices = ", ".join(POOLING_TYPES)
            raise SamplingParamsError("pooling", f"must be one of {choices}, got {self.pooling!r}")
        # A pooling request samples nothing: what only generation reads must be unset.
        for name, unset in (
            ("n", 1),
            ("logprobs", None),
            ("prompt_logprobs", None),
            ("structured_outputs", None),
            ("stop", []),
            ("min_tokens", 0),
        ):
            if getattr(self, name) != unset:
                raise SamplingParamsError("pooling", f"a pooling request cannot set {name}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
