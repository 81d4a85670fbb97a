"""Structured outputs: the constraint a request puts on its output, and its up-front check.

A request names exactly one of a JSON schema, "any JSON object", a regular
expression, a list of choices or a grammar (Lark, or llama.cpp's GBNF); the worker
turns it into a token mask per step (worker_svc/structured.py). The grammar engine is
llguidance (benchmarks/structured.py and docs/benchmarks.md say why): it imports in
milliseconds without torch, so the gateway and the scheduler check a spec with the
very engine the worker runs, and what they accept the worker can compile.

This module imports nothing above services/ (llguidance is imported lazily).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

# A spec longer than this is refused up front: compiling and checking it would be
# work done on the request path for what is surely a mistake or an attack.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024

# Compact separators (", " and ": ") rather than any whitespace: a small model given the
# freedom writes newlines and spaces until max_tokens runs out (as vLLM's
# disable-any-whitespace); with them off the output is short and always closes.
_JSON_DEFAULTS = {"whitespace_flexible": False}


class StructuredOutputsError(ValueError):
    """The spec is invalid, unsupported or too costly; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@functools.cache
def parser_limits() -> Any:
    """Bounds on the engine's work per grammar and per token: a spec that exceeds them is an
    error (at check time, or as a matcher error that ends the choice), never a stalled step."""
    import llguidance

    return llguidance.LLParserLimits(max_grammar_size=200_000, max_lexer_states=50_000)


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one field set (vLLM's StructuredOutputsParams, the same names)."""

    json: str | None = None  # a JSON schema, as JSON text (dict accepted, stored canonical)
    json_object: bool = False  # any JSON object (OpenAI response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # Lark (llguidance's syntax) or GBNF

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            if not isinstance(self.json, dict | bool):
                raise StructuredOutputsError("json", "must be a JSON schema (an object) or its JSON text")
            # Property order is kept: the output follows it (as OpenAI strict mode does).
            object.__setattr__(self, "json", json.dumps(self.json, separators=(",", ":")))
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple):
                raise StructuredOutputsError("choice", "must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        set_fields = self._set_fields()
        return set_fields[0] if len(set_fields) == 1 else ""

    def _set_fields(self) -> list[str]:
        out = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            out.append("json_object")
        return out

    @functools.cached_property  # noqa: B019 - frozen dataclass: computed once per instance
    def key(self) -> str:
        """Stable hash of the spec: the worker's compiled-grammar cache key."""
        payload = json.dumps(
            {"kind": self.kind, "value": getattr(self, self.kind) if self.kind else None},
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    def validate(self) -> None:
        """Raise StructuredOutputsError for a spec the engine would refuse (cached by spec)."""
        fields = self._set_fields()
        if len(fields) != 1:
            raise StructuredOutputsError(
                "structured_outputs",
                "exactly one of json, json_object, regex, choice, grammar must be set, got "
                + (", ".join(fields) or "none"),
            )
        _check_spec(self)

    def to_llguidance(self) -> str:
        """The llguidance grammar of the spec (raises StructuredOutputsError)."""
        import llguidance

        kind = self.kind
        try:
            if kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(self.json, defaults=_JSON_DEFAULTS)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    '{"type":"object"}', defaults=_JSON_DEFAULTS
                )
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.regex)
            if kind == "choice":
                return llguidance.grammar_from("choice", json.dumps(list(self.choice)))
            return llguidance.grammar_from("grammar", self.grammar)
        except (ValueError, TypeError) as e:
            raise StructuredOutputsError(kind, f"is not valid: {e}") from None


def _static_checks(so: StructuredOutputs) -> None:
    kind = so.kind
    if kind == "json_object":
        return
    if kind == "choice":
        if not so.choice:
            raise StructuredOutputsError("choice", "must list at least one string")
        if len(so.choice) > MAX_CHOICES:
            raise StructuredOutputsError("choice", f"at most {MAX_CHOICES} choices, got {len(so.choice)}")
        if any(not isinstance(c, str) or not c for c in so.choice):
            raise StructuredOutputsError("choice", "choices must be non-empty strings")
        size = sum(len(c) for c in so.choice)
    else:
        value = getattr(so, kind)
        if not isinstance(value, str) or not value.strip():
            raise StructuredOutputsError(kind, "must be a non-empty string")
        size = len(value)
    if size > MAX_SPEC_CHARS:
        raise StructuredOutputsError(kind, f"is {size} characters; at most {MAX_SPEC_CHARS} are allowed")
    if kind == "json":
        try:
            schema = json.loads(so.json)
        except ValueError as e:
            raise StructuredOutputsError("json", f"is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise StructuredOutputsError("json", "must be a JSON schema object")


@functools.lru_cache(maxsize=1024)
def _check_spec(so: StructuredOutputs) -> None:
    # lru_cache keeps successes only (an exception is not cached): a bad spec sent again is
    # checked again, which costs about a millisecond.
    _static_checks(so)
    import llguidance

    grammar = so.to_llguidance()
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, None, limits=parser_limits()
        )
    except (ValueError, RuntimeError) as e:
        raise StructuredOutputsError(so.kind, f"is not supported: {e}") from None
    if is_error:
        detail = "; ".join(m.strip() for m in messages)[:500]
        raise StructuredOutputsError(so.kind, f"is invalid or unsupported: {detail}")
