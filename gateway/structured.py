"""OpenAI `response_format`, vLLM `structured_outputs` / `guided_*` and `tools` -> one StructuredOutputs.

Every spec is checked here, with the engine the worker runs (services/structured_outputs.py),
before anything is tokenized or submitted: a bad schema, regex, grammar or tool name is a 400
naming the request's own parameter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import bad_request
from gateway.protocol import ChatCompletionRequest, SamplingRequest, Tool
from gateway.tool_parsers import TOOL_CALL_END, TOOL_CALL_START
from services.structured_outputs import StructuredOutputs, StructuredOutputsError

# Tool calling modes (OpenAI tool_choice).
NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"


def _checked(param: str, **spec: Any) -> StructuredOutputs:
    try:
        so = StructuredOutputs(**spec)
        so.validate()
    except StructuredOutputsError as e:
        raise bad_request(param, str(e).split(": ", 1)[-1]) from None
    return so


def structured_outputs(req: SamplingRequest) -> StructuredOutputs | None:
    """The request's output constraint, from whichever of its fields names one (at most one)."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise bad_request("response_format", "type 'json_schema' needs json_schema.schema")
        found.append(("response_format.json_schema.schema", {"json": rf.json_schema.json_schema}))
    so = req.structured_outputs
    if so is not None:
        spec = {
            name: value
            for name, value in (
                ("json", so.json_),
                ("json_object", so.json_object or None),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
            )
            if value is not None
        }
        if len(spec) != 1:
            raise bad_request(
                "structured_outputs",
                f"exactly one of json, json_object, regex, choice, grammar must be set, got {sorted(spec)}",
            )
        (name,) = spec
        found.append((f"structured_outputs.{name}", spec))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            found.append((f"guided_{name}", {name: value}))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(found[1][0], f"cannot be combined with {found[0][0]}: give one output constraint")
    param, spec = found[0]
    return _checked(param, **spec)


@dataclass
class ToolPlan:
    """How a chat request uses its tools."""

    mode: str = NONE
    tools: list[Tool] = field(default_factory=list)
    named: str | None = None  # NAMED: the function the output's arguments are for
    spec: StructuredOutputs | None = None  # REQUIRED / NAMED: what the output is held to

    @property
    def render(self) -> bool:
        """Whether the template shows the model the tools."""
        return self.mode != NONE and bool(self.tools)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _has_ref(value: Any) -> bool:
    if isinstance(value, dict):
        return "$ref" in value or any(_has_ref(v) for v in value.values())
    return isinstance(value, list) and any(_has_ref(v) for v in value)


def _rebased(value: Any, base: str) -> Any:
    """`value` with every local `$ref` ("#", "#/...") moved under the JSON pointer `base`."""
    if isinstance(value, list):
        return [_rebased(v, base) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _rebased(v, base) for k, v in value.items()}
    ref = value.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and (len(ref) == 1 or ref[1] == "/"):
        out["$ref"] = "#" + base + ref[1:]
    return out


# The separators json.dumps writes, as in the tool listings and examples models are shown (and
# as OpenAI's arguments read); no other whitespace: a small model given the freedom pads forever.
_CALLS_FORMAT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more {"name", "arguments"} calls of the given tools (vLLM's).

    Each tool's parameters schema sits inside the array, no longer at a schema's root: one
    whose `$ref`s point at its own root (pydantic's `#/$defs/...`) moves whole to the array's
    `$defs` under its own key, its pointers rebased there (vLLM merges the tools' `$defs`
    instead, and refuses two tools that define one name differently).
    """
    defs: dict[str, Any] = {}
    variants = []
    for i, t in enumerate(tools):
        arguments = _parameters(t)
        if _has_ref(arguments):
            key = f"tool_{i}"
            defs[key] = _rebased(arguments, f"/$defs/{key}")
            arguments = {"$ref": f"#/$defs/{key}"}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    schema["x-guidance"] = _CALLS_FORMAT
    return schema


def required_spec(tools: list[Tool], parallel: bool, tagged: bool) -> dict[str, Any]:
    """The output constraint of tool_choice "required": the calls' JSON array, inside
    `<tool_call>...</tool_call>` when the model was shown that format (`tagged`).

    The tags matter: SmolLM2, shown its own format, closes the list after its calls; held to a
    bare array it repeats the last call until max_tokens runs out (the array may end after
    any call either way, and the end of the output may follow).
    """
    schema = required_schema(tools, parallel)
    if not tagged:
        return {"json": schema}
    body = json.dumps(schema, ensure_ascii=False)
    return {"grammar": f'start: "{TOOL_CALL_START}" calls "{TOOL_CALL_END}"\ncalls: %json {body}\n'}


def shows_tool_call_tags(chat_template: Any) -> bool:
    """Whether a prompt with tools shows the model `<tool_call>` blocks: the template's own
    (Hermes, Qwen), or SmolLM2's system prompt, which gateway/tokenizer.py adds for a template
    that renders no tools."""
    renders_tools = isinstance(chat_template, str) and "tools" in chat_template
    return not renders_tools or TOOL_CALL_START in chat_template


def tool_plan(req: ChatCompletionRequest, tagged: bool = False) -> ToolPlan:
    """`tagged`: the prompt shows the model `<tool_call>` blocks (gateway/tokenizer.py), so that
    forced calls are written in them."""
    tools = req.tools or []
    choice = req.tool_choice
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools", "function names must be unique")
    for i, t in enumerate(tools):  # every schema is checked, whatever tool_choice says
        if t.function.parameters is not None:
            _checked(f"tools[{i}].function.parameters", json=t.function.parameters)
    if choice is None:
        choice = AUTO if tools else NONE
    if choice == NONE or (choice == AUTO and not tools):
        return ToolPlan(NONE, tools)
    if not tools:
        raise bad_request(
            "tool_choice", f"{json.dumps(choice if isinstance(choice, str) else choice.type)} needs tools"
        )
    if choice == AUTO:
        return ToolPlan(AUTO, tools)
    if choice == REQUIRED:
        spec = _checked("tools", **required_spec(tools, req.parallel_tool_calls, tagged))
        return ToolPlan(REQUIRED, tools, spec=spec)
    name = choice.function.name
    if name not in names:
        raise bad_request("tool_choice", f"function {name!r} is not among the tools ({', '.join(names)})")
    tool = tools[names.index(name)]
    return ToolPlan(NAMED, tools, named=name, spec=_checked("tool_choice", json=_parameters(tool)))
