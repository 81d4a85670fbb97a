from __future__ import annotations

import json

from gateway.serving_chat import ToolCallStream, split_tool_calls
from gateway.structured import REQUIRED, ToolPlan
from gateway.tool_parsers import AutoToolStream, parse_required, parse_tool_calls


def test_hermes_blocks_and_smollm2_list():
    text = 'Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    text += '<tool_call>{"name": "g"}</tool_call>'
    content, calls = parse_tool_calls(text, {"f", "g"})
    assert content == "Sure." and [c.name for c in calls] == ["f", "g"]
    assert json.loads(calls[0].arguments) == {"x": 1} and calls[1].arguments == "{}"
    content, calls = parse_tool_calls(
        '<tool_call>[{"name": "f", "arguments": {"a": "b"}}]</tool_call>', {"f"}
    )
    assert content == "" and calls[0].to_openai()["function"] == {"name": "f", "arguments": '{"a": "b"}'}


def test_bad_or_unknown_calls_stay_text():
    for text in ["<tool_call>{not json</tool_call>", '<tool_call>{"name": "zzz"}</tool_call>', "plain"]:
        assert parse_tool_calls(text, {"f"}) == (text, [])


def test_required_output():
    calls = parse_required('[{"name": "f", "arguments": {"x": 2}}, {"name": "g", "arguments": {}}]')
    assert [c.name for c in calls] == ["f", "g"] and len({c.id for c in calls}) == 2
    assert parse_required('[{"name": "f", "argu') == []
    assert parse_required("Sorry, I cannot.") == parse_required("<tool_call>{}") == []


CALLS = '<tool_call>[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]</tool_call>'


def test_required_calls_in_tags_and_cut_by_max_tokens():
    """The grammar's `<tool_call>[...]</tool_call>`; cut by max_tokens, the whole calls are kept
    and the text is not content."""
    plan = ToolPlan(REQUIRED)
    content, calls = split_tool_calls(plan, CALLS, "stop")
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}'), ("g", "{}")]
    content, calls = split_tool_calls(plan, CALLS[:60], "length")
    assert content is None and [c.name for c in calls] == ["f"]
    assert split_tool_calls(plan, "<tool_call>[{", "length") == ("<tool_call>[{", [])


def test_required_stream_sends_each_call_once_whole():
    s = ToolCallStream(ToolPlan(REQUIRED))
    pieces = [CALLS[i : i + 7] for i in range(0, len(CALLS), 7)]
    out = [s.delta(p, "stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    sent = [tc for fields, _ in out for tc in fields.get("tool_calls", [])]
    assert [(tc["index"], tc["function"]["name"]) for tc in sent] == [(0, "f"), (1, "g")]
    assert all("content" not in fields for fields, _ in out) and out[-1][1] == "tool_calls"
    fields, finish = ToolCallStream(ToolPlan(REQUIRED)).delta(CALLS[:60], "length")
    assert finish == "length" and list(fields) == ["tool_calls"]
    assert fields["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    s = ToolCallStream(ToolPlan(REQUIRED))
    assert s.delta("<tool_call>[{", "length") == ({"content": "<tool_call>[{"}, "length")


def test_stream_holds_back_a_possible_tag():
    s = AutoToolStream({"f"})
    assert s.feed("Hello <tool") == "Hello "
    assert s.feed('_call>[{"name": "f", ') == ""
    assert s.feed('"arguments": {}}]</tool_call>') == ""
    assert s.finish()[1][0].name == "f"
    s = AutoToolStream({"f"})
    assert s.feed("a <b") + s.feed("c") == "a <bc"
    assert s.finish() == ("", [])
    s = AutoToolStream({"f"})
    assert s.feed("x <") == "x "
    assert s.finish() == ("<", [])
