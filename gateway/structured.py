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


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more {"name", "arguments"} calls of the given tools (vLLM's)."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in tools
            ]
        },
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_plan(req: ChatCompletionRequest) -> ToolPlan:
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
        spec = _checked("tools", json=required_schema(tools, req.parallel_tool_calls))
        return ToolPlan(REQUIRED, tools, spec=spec)
    name = choice.function.name
    if name not in names:
        raise bad_request("tool_choice", f"function {name!r} is not among the tools ({', '.join(names)})")
    tool = tools[names.index(name)]
    return ToolPlan(NAMED, tools, named=name, spec=_checked("tool_choice", json=_parameters(tool)))
