"""One request's n choices: how they fan out, how long they may run, and the output of each.

The offline API (`llmesh/llm.py`), the scheduler's gRPC edge (`scheduler_svc/servicer.py`) and
the gateway (`gateway/generation.py`) all turn one request into n sequences and fold the tokens
that come back into per-choice outputs. This module is the one place that does it:

- **fan-out** (`FanOut`): child ids (`parent-i`), per-choice seeds (`seed + i`, wrapped into
  int64 so that every seed a request may carry works for every n) and the children's
  `SamplingParams`, all built and validated before anything is submitted; then submitted all or
  nothing: a failure on any choice aborts those already submitted before it propagates.
- **length checks** (`fit_max_tokens`): prompt + max_tokens against the context length.
- **per-choice output** (`ChoiceState`): incremental detokenization, stop strings (matched as
  each token arrives; the tokens after the one that completed a match are dropped), text held
  back while it may still become a stop string, finish and stop reasons. Text is decoded as it
  streams, once at the end, or not at all (`detokenize=False`, no tokenizer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.detokenizer import IncrementalDetokenizer, find_stop, held_back
from services.sampling_params import SamplingParams, SamplingParamsError

INT64_MIN = -(2**63)
_SEED_SPAN = 2**64

STOP, LENGTH, ABORT = "stop", "length", "abort"  # finish reasons, as OpenAI and vLLM spell them


# ----- fan-out --------------------------------------------------------------------------------


def child_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: `seed + index` (vLLM's convention), wrapped into int64 (the wire's type)."""
    if seed is None:
        return None
    return (seed + index - INT64_MIN) % _SEED_SPAN + INT64_MIN


def child_id(parent: str, index: int) -> str:
    return f"{parent}-{index}"


@dataclass
class FanOut:
    """The n sequences of one request: ids and parameters, every one valid before any is submitted."""

    ids: list[str]
    params: list[SamplingParams]

    @classmethod
    def plan(
        cls, parent: str, params: SamplingParams, *, keep_stop: bool = True, prompt_logprobs_once: bool = True
    ) -> FanOut:
        """n children of `params` (n = 1 each, seeds `seed + i`); raises SamplingParamsError.

        keep_stop=False leaves stop strings out of the children (the gateway matches them on its
        own text and sends the scheduler token-level work only). Prompt logprobs are the same for
        every choice: only the first computes them, unless prompt_logprobs_once=False (a caller
        that streams each choice's echo with them).
        """
        if params.n == 1 and keep_stop:
            return cls([child_id(parent, 0)], [params])
        stop = params.stop if keep_stop else []
        children = [
            # replace() validates each child again: an invalid one fails here, before submission.
            dataclasses.replace(
                params,
                n=1,
                seed=child_seed(params.seed, i),
                stop=list(stop),
                prompt_logprobs=params.prompt_logprobs if i == 0 or not prompt_logprobs_once else None,
            )
            for i in range(params.n)
        ]
        return cls([child_id(parent, i) for i in range(params.n)], children)

    def __len__(self) -> int:
        return len(self.ids)

    def submit(self, submit: Callable[[str, SamplingParams], object], abort: Callable[[str], object]) -> None:
        """`submit(id, params)` each child in order; if one raises, `abort` those submitted, re-raise."""
        done: list[str] = []
        try:
            for cid, sp in zip(self.ids, self.params, strict=True):
                submit(cid, sp)
                done.append(cid)
        except BaseException:
            for cid in done:
                abort(cid)
            raise


# ----- length ---------------------------------------------------------------------------------


class ContextLengthError(SamplingParamsError):
    """The prompt (with max_tokens) does not fit the context; `param` is "prompt" or "max_tokens"."""

    def __init__(self, param: str, prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
        if param == "prompt":
            why = f"{prompt_len} tokens leave no room in the context length (max_model_len {max_model_len})"
        else:
            why = (
                f"prompt ({prompt_len}) + max_tokens ({max_tokens}) = {prompt_len + (max_tokens or 0)} "
                f"tokens exceed the context length (max_model_len {max_model_len})"
            )
        super().__init__(param, why)
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


def fit_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int, *, cap: bool = False) -> int:
    """The tokens a sequence may generate: `max_tokens`, or all the context leaves when None.

    A prompt that leaves no room raises ContextLengthError("prompt"). A max_tokens beyond the
    room raises ContextLengthError("max_tokens") at the front doors (OpenAI's 400), or is cut to
    the room with cap=True (the offline API, where a sequence then ends with "length").
    """
    room = max_model_len - prompt_len
    if room <= 0:
        raise ContextLengthError("prompt", prompt_len, max_tokens, max_model_len)
    if max_tokens is None:
        return room
    if max_tokens > room:
        if cap:
            return room
        raise ContextLengthError("max_tokens", prompt_len, max_tokens, max_model_len)
    return max_tokens


# ----- per-choice output ----------------------------------------------------------------------


class _StreamDetokenizer:
    """IncrementalDetokenizer's interface over the tokenizers library's DecodeStream (Rust).

    About 1 µs a token instead of two Python-level decodes of a window (~5 µs). Text equals the
    window method's: pieces come out only as whole characters; at the end, tokens still held
    (an incomplete UTF-8 sequence) come out as what a plain decode makes of them.
    """

    def __init__(self, hf: Any, skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self._hf = hf
        self._backend = hf.backend_tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # tokens read since the last piece of text
        self.text = ""

    def push(self, new_token_ids: Sequence[int]) -> str:
        out = []
        step = self._stream.step
        for token_id in new_token_ids:
            try:
                piece = step(self._backend, token_id)
            except Exception:  # e.g. "Invalid prefix": restart the stream from this token
                from tokenizers.decoders import DecodeStream

                self._stream = DecodeStream(skip_special_tokens=self._skip)
                step = self._stream.step
                piece = step(self._backend, token_id)
                self._held.clear()
            if not piece:  # None while a character is incomplete ("" for a skipped special token)
                self._held.append(token_id)
            else:
                self._held.clear()
                out.append(piece)
        new = "".join(out)
        self.text += new
        return new

    def flush(self) -> str:
        rest = ""
        if self._held:
            rest = self._hf.decode(self._held, skip_special_tokens=self._skip)
            self._held.clear()
        self.text += rest
        return rest


def make_detokenizer(tokenizer: Any, skip_special_tokens: bool = True):
    """An incremental detokenizer for a Hugging Face tokenizer: DecodeStream where it gives the
    same text as `tokenizer.decode` (a fast tokenizer without post-decode clean-up), else the
    window method of services/detokenizer.py."""
    if getattr(tokenizer, "backend_tokenizer", None) is not None and not getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    ):
        try:
            return _StreamDetokenizer(tokenizer, skip_special_tokens)
        except ImportError:  # tokenizers < 0.21
            pass
    return IncrementalDetokenizer(tokenizer, skip_special_tokens)


@dataclass
class Update:
    """What one batch of a choice's tokens changed."""

    num_tokens: int  # of the tokens given, how many count (fewer when a stop string ended the choice)
    text: str  # text newly safe to hand out ("" when text is not streamed)
    cancel: bool  # the choice ended here while its sequence upstream still runs: abort it


class ChoiceState:
    """One choice as its tokens arrive: detokenized, stop strings matched, finish and stop reasons.

    tokenizer: a Hugging Face tokenizer, or None for token ids only.
    stream_text: hand out text as it arrives (`Update.text`), held back while it may still become a
        stop string; False decodes once, when the choice finishes, unless stop strings must be
        matched as tokens arrive.
    keep_token_ids: collect the counted tokens in `token_ids` (the offline API's output).
    """

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        stream_text: bool = True,
        keep_token_ids: bool = False,
    ) -> None:
        if stop and tokenizer is None:
            raise ValueError("stop strings are matched on text: they need a tokenizer")
        self.stops = list(stop)
        self.stop_token_ids = stop_token_ids
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self._tokenizer = tokenizer
        incremental = tokenizer is not None and (stream_text or bool(stop))
        self._detok = make_detokenizer(tokenizer, skip_special_tokens) if incremental else None
        self._decode_at_end = tokenizer is not None and not incremental
        self._final_text: str | None = None
        self.stream_text = stream_text
        self.token_ids: list[int] | None = [] if keep_token_ids or self._decode_at_end else None
        self.num_tokens = 0
        self.sent = 0  # characters of text already handed out
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def text(self) -> str:
        """The text so far. With stream_text=False and no stop strings, "" until the choice
        finishes, then decoded once, on first access (by whoever reads it, off the step loop)."""
        if self._detok is not None:
            return self._detok.text
        if self._final_text is None:
            if not (self._decode_at_end and self.finished):
                return ""
            self._final_text = self._tokenizer.decode(
                self.token_ids, skip_special_tokens=self.skip_special_tokens
            )
        return self._final_text

    def absorb(
        self, token_ids: Sequence[int], finish_reason: str | None = None, stop_token_id: int | None = None
    ) -> Update:
        """Fold in tokens and, with the last of them, the upstream finish reason (if it ended).

        `stop_token_id` names the stop token that ended it when upstream says so; else a "stop"
        on a token of `stop_token_ids` names that token. A choice that already finished takes
        nothing more.
        """
        if self.finished:
            return Update(0, "", False)
        count = len(token_ids)
        cancel = False
        detok = self._detok
        if detok is not None:
            if self.stops:
                for j, tok in enumerate(token_ids):
                    new = detok.push((tok,))
                    if new and self._match_stop(len(new)):
                        count = j + 1
                        cancel = finish_reason is None or j < len(token_ids) - 1
                        break
            else:
                detok.push(token_ids)
        self.num_tokens += count
        if self.token_ids is not None:
            self.token_ids.extend(token_ids if count == len(token_ids) else token_ids[:count])
        if finish_reason is not None and not self.finished:
            rest = detok.flush() if detok is not None else ""
            if not (rest and self.stops and self._match_stop(len(rest))):
                self.finished = True
                self.finish_reason = finish_reason
                if finish_reason == STOP:
                    if stop_token_id is not None:
                        self.stop_reason = stop_token_id
                    elif count and token_ids[count - 1] in self.stop_token_ids:
                        self.stop_reason = token_ids[count - 1]
        text = ""
        if detok is not None and self.stream_text:
            end = len(detok.text)
            if not self.finished and self.stops:
                end -= held_back(detok.text, self.stops)
            if end > self.sent:
                text = detok.text[self.sent : end]
                self.sent = end
        return Update(count, text, cancel)

    def _match_stop(self, new_len: int) -> bool:
        detok = self._detok
        text = detok.text
        idx = find_stop(text, new_len, self.stops)
        if idx == -1:
            return False
        stop = next(s for s in self.stops if text.startswith(s, idx))
        detok.text = text[: idx + len(stop)] if self.include_stop else text[:idx]
        self.finished = True
        self.finish_reason = STOP
        self.stop_reason = stop
        return True
