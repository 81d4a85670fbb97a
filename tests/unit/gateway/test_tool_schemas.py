"""The grammar of tool_choice "required" (#34): a list of calls that may end, in the model's
`<tool_call>` format, whose tools' `$defs` / `$ref` schemas resolve (real llguidance, SmolLM2's
tokenizer)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest, Tool
from gateway.structured import REQUIRED, _rebased, required_spec, shows_tool_call_tags, tool_plan
from services.structured_outputs import StructuredOutputs, parser_limits

# What pydantic writes for a model with a nested model, an enum and a recursive field.
PYDANTIC_ARGS = {
    "$defs": {
        "Place": {
            "properties": {"city": {"type": "string", "maxLength": 12}, "near": {"$ref": "#/$defs/Place"}},
            "required": ["city"],
            "type": "object",
        },
        "Unit": {"enum": ["celsius", "fahrenheit"], "type": "string"},
    },
    "properties": {"place": {"$ref": "#/$defs/Place"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["place", "unit"],
    "type": "object",
}
# Another tool whose `$defs` use the same name for something else.
OTHER_ARGS = {
    "$defs": {"Unit": {"enum": ["kelvin"], "type": "string"}},
    "properties": {"unit": {"$ref": "#/$defs/Unit"}},
    "required": ["unit"],
    "type": "object",
}
TOOLS = [
    Tool(function={"name": "weather", "parameters": PYDANTIC_ARGS}),
    Tool(function={"name": "other", "parameters": OTHER_ARGS}),
    Tool(function={"name": "plain"}),
]
PARIS = {
    "name": "weather",
    "arguments": {"place": {"city": "Paris", "near": {"city": "Lyon"}}, "unit": "celsius"},
}
KELVIN = {"name": "other", "arguments": {"unit": "kelvin"}}


@pytest.fixture(scope="module")
def accepts(hf_tokenizer):
    import llguidance
    import llguidance.hf

    lltok = llguidance.hf.from_tokenizer(hf_tokenizer)

    def run(spec: dict[str, Any], text: str) -> bool:
        """Whether the whole `text` is an output the spec allows to end there."""
        m = llguidance.LLMatcher(lltok, StructuredOutputs(**spec).to_llguidance(), limits=parser_limits())
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    return run


def _text(calls: list[dict[str, Any]], tagged: bool) -> str:
    body = json.dumps(calls)  # the separators the grammar writes
    return f"<tool_call>{body}</tool_call>" if tagged else body


@pytest.mark.parametrize("tagged", [True, False], ids=["tagged", "bare"])
def test_required_calls_with_defs_refs_end_after_any_call(accepts, tagged):
    spec = required_spec(TOOLS, parallel=True, tagged=tagged)
    StructuredOutputs(**spec).validate()  # was: Pointer '/$defs/Unit' does not exist
    plain = {"name": "plain", "arguments": {}}
    for calls in ([PARIS], [PARIS, KELVIN], [KELVIN, plain, PARIS]):
        assert accepts(spec, _text(calls, tagged)), calls
    assert not accepts(spec, _text([], tagged))  # at least one call
    assert not accepts(spec, _text([PARIS], tagged)[:-2])  # not before the list closes
    bad_unit = {"name": "weather", "arguments": {**PARIS["arguments"], "unit": "kelvin"}}
    assert not accepts(spec, _text([bad_unit], tagged))  # each tool's own "Unit"
    assert not accepts(spec, _text([{"name": "other", "arguments": {"unit": "celsius"}}], tagged))
    one = required_spec(TOOLS, parallel=False, tagged=tagged)
    assert accepts(one, _text([PARIS], tagged)) and not accepts(one, _text([PARIS, KELVIN], tagged))


def test_rebased_refs():
    schema = {"$ref": "#", "items": [{"$ref": "#/$defs/A~1b"}], "x": {"$ref": "https://e.org/s.json"}}
    assert _rebased(schema, "/$defs/tool_0") == {
        "$ref": "#/$defs/tool_0",
        "items": [{"$ref": "#/$defs/tool_0/$defs/A~1b"}],
        "x": {"$ref": "https://e.org/s.json"},
    }


def test_plan_and_tags():
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        tools=[t.model_dump(exclude_none=True) for t in TOOLS],
        tool_choice="required",
    )
    plan = tool_plan(req, tagged=True)
    assert plan.mode == REQUIRED and plan.spec.grammar.startswith('start: "<tool_call>" calls "</tool_call>"')
    assert tool_plan(req).spec.kind == "json"
    broken = {"type": "object", "properties": {"u": {"$ref": "#/$defs/Missing"}}}
    with pytest.raises(APIError):
        tool_plan(req.model_copy(update={"tools": [Tool(function={"name": "f", "parameters": broken})]}))
    assert shows_tool_call_tags(None)  # SmolLM2's system prompt, added by the gateway
    assert shows_tool_call_tags("{{ messages }}")
    assert shows_tool_call_tags("{% for t in tools %}<tool_call>{% endfor %}")  # Hermes, Qwen
    assert not shows_tool_call_tags("{% for t in tools %}{{ t | tojson }}{% endfor %}")
