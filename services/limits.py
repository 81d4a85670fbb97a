"""Caps on one request, the same at both front doors (the HTTP gateway and the scheduler's gRPC API).

Each cap bounds work a caller can make the mesh do per request; a request over
a cap is refused before any work is done (400 / INVALID_ARGUMENT). Both
services' configs inherit `RequestLimits`, so the flags read the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.config import option
from services.sampling_params import SamplingParams, SamplingParamsError


@dataclass
class RequestLimits:
    """Per-request caps shared by the gateway and the scheduler."""

    max_n: int = option(16, help="largest `n` (choices per prompt)")
    max_logprobs: int = option(20, help="largest `logprobs` / `top_logprobs`")
    max_stop: int = option(16, help="most stop strings per request")
    max_stop_chars: int = option(256, help="longest stop string, in characters")
    max_stop_token_ids: int = option(64, help="most stop_token_ids per request")

    def __post_init__(self) -> None:
        for name in ("max_n", "max_stop", "max_stop_chars", "max_stop_token_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")

    def check_counts(self, num_stop: int, num_stop_token_ids: int) -> None:
        """The list caps alone: cheap enough to run before a body's lists are walked."""
        if num_stop_token_ids > self.max_stop_token_ids:
            raise SamplingParamsError(
                "stop_token_ids", f"at most {self.max_stop_token_ids} ids, got {num_stop_token_ids}"
            )
        if num_stop > self.max_stop:
            raise SamplingParamsError("stop", f"at most {self.max_stop} stop strings, got {num_stop}")

    def check(self, params: SamplingParams, vocab_size: int) -> None:
        """Raise SamplingParamsError (naming the parameter) for what exceeds a cap."""
        if params.n > self.max_n:
            raise SamplingParamsError("n", f"must be <= {self.max_n}, got {params.n}")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise SamplingParamsError("logprobs", f"must be <= {self.max_logprobs}, got {params.logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.max_logprobs:
            raise SamplingParamsError(
                "prompt_logprobs", f"must be <= {self.max_logprobs}, got {params.prompt_logprobs}"
            )
        self.check_counts(len(params.stop), len(params.stop_token_ids))
        if any(len(s) > self.max_stop_chars for s in params.stop):
            raise SamplingParamsError(
                "stop", f"stop strings must be at most {self.max_stop_chars} characters"
            )
        ids = params.stop_token_ids
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise SamplingParamsError(
                "stop_token_ids", f"token ids must be in [0, {vocab_size}), got {bad[:5]}"
            )


# Text longer than this is tokenized in a thread, off the event loop that serves every stream;
# below it, encoding (tens of microseconds) is cheaper than the thread hop.
INLINE_TOKENIZE_CHARS = 4096


def prompt_char_limit(max_model_len: int, longest_token_chars: int) -> int:
    """Characters beyond which a text prompt surely exceeds `max_model_len` tokens.

    No token covers more than `longest_token_chars` characters of text, so a
    longer text needs more tokens than the context holds: refuse it without
    tokenizing megabytes first.
    """
    return max_model_len * max(longest_token_chars, 1)


def longest_token_chars(tokenizer) -> int:
    """Longest decoded token of a Hugging Face tokenizer's vocabulary (computed once at load)."""
    longest = 1
    for token_id in range(len(tokenizer)):
        text = tokenizer.convert_ids_to_tokens(token_id)
        if text is not None:
            longest = max(longest, len(text))
    return longest
