from __future__ import annotations

import json

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
