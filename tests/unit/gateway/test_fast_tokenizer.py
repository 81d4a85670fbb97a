"""The gateway's tokenizer without transformers (gateway/fast_tokenizer.py, gateway/chat_template.py)
gives transformers' token ids, text and rendered chat prompts: transformers, in the test env, is
the reference; the real SmolLM2 tokenizer, and its tokenizer.json under other chat templates."""

from __future__ import annotations

import json
import logging
import random
import shutil
import sys
from pathlib import Path

import pytest

from gateway import fast_tokenizer
from gateway.fast_tokenizer import FastTokenizer
from gateway.protocol import ChatMessage, Tool
from gateway.state import _load_tokenizer
from gateway.tokenizer import Tokenizer
from services.model_files import load_tokenizer, resolve_model

PROSE = (Path(__file__).parents[2] / "data" / "prose.txt").read_text(encoding="utf-8")
TEXTS = [
    "",
    " ",
    "Hello, world!",
    "  two  spaces\tand\ttabs\n\nnewlines ",
    "naïve café — “quotes” 日本語のテキスト 🤖🚀 and e\u0301",
    "<|im_start|>user\nspecial tokens written as text<|im_end|>\n<|endoftext|>",
    "<|im_start|><|im_start|> glued<|im_end|>x",
    "def f(x):\n    return x ** 2  # code\n",
    PROSE[:4000],
]

# A template that uses what transformers' sandbox adds: tools, tojson, namespace, loop controls,
# raise_exception, {% generation %}, the special tokens, documents.
RICH_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{%- if tools %}TOOLS {{ tools | tojson }}
{% endif %}
{%- for m in messages %}{% if m.content == 'bad' %}{{ raise_exception('no bad content') }}{% endif %}
{%- set ns.n = ns.n + 1 %}{% if m.content == 'skip' %}{% continue %}{% endif %}
<{{ m.role }}{% if m.name is defined %} name={{ m.name }}{% endif %}>
{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}
{%- else %}{{ m.content }}{% endif %}
{%- if m.tool_calls is defined %}{{ m.tool_calls | tojson(indent=2) }}{% endif %}
{%- if m.tool_call_id is defined %}[{{ m.tool_call_id }}]{% endif %}</{{ m.role }}>{{ eos_token }}
{% endfor %}{{ ns.n }}{% if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.fixture(scope="module")
def smollm_folder() -> str:
    return resolve_model(None)


def _folder_with(tmp_path: Path, source: str, template: str | list | None, **config) -> str:
    """SmolLM2's tokenizer.json under another tokenizer_config.json (and chat template)."""
    out = tmp_path / "model"
    out.mkdir()
    shutil.copy(Path(source) / "tokenizer.json", out / "tokenizer.json")
    base = json.loads((Path(source) / "tokenizer_config.json").read_text())
    if template is not None:
        base["chat_template"] = template
    base.update(config)
    (out / "tokenizer_config.json").write_text(json.dumps(base))
    (out / "config.json").write_text("{}")
    return str(out)


def _pair(folder: str) -> tuple[object, object]:
    fast = fast_tokenizer.load(folder)
    assert isinstance(fast, FastTokenizer)
    return fast, load_tokenizer(folder)


def test_the_embedded_model_loads_on_the_fast_path(smollm_folder) -> None:
    tok = _load_tokenizer(smollm_folder, None)  # what the gateway does with the scheduler's folder
    assert isinstance(tok, FastTokenizer)
    assert isinstance(_load_tokenizer(None, None), FastTokenizer)  # the embedded GGUF, converted


def test_ids_text_and_vocabulary_equal_transformers(smollm_folder) -> None:
    fast, hf = _pair(smollm_folder)
    assert len(fast) == len(hf)
    assert fast.special_tokens_map == hf.special_tokens_map
    assert fast.chat_template == hf.chat_template
    assert fast.clean_up_tokenization_spaces == hf.clean_up_tokenization_spaces
    for text in TEXTS:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special
            )
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 12))] + [0, 1, 2]
        rng.shuffle(ids)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    for token_id in list(range(0, 40)) + [rng.randrange(len(hf)) for _ in range(200)]:
        assert fast.convert_ids_to_tokens(token_id) == hf.convert_ids_to_tokens(token_id)


def _conversations() -> list[tuple[list[ChatMessage], dict]]:
    tool = Tool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "description": "ville à <b>"}},
                },
            },
        }
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    m = ChatMessage.model_validate
    return [
        ([m({"role": "user", "content": "Say hello."})], {}),
        ([m({"role": "system", "content": "Be brief."}), m({"role": "user", "content": "日本語 🤖"})], {}),
        ([m({"role": "user", "content": "Hi"})], {"add_generation_prompt": False}),
        (
            [m({"role": "user", "content": "Hi"}), m({"role": "assistant", "content": "Hel"})],
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
        (
            [m({"role": "user", "content": "Hi"}), m({"role": "assistant", "content": "trailing  "})],
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
        (
            [
                m(
                    {
                        "role": "user",
                        "name": "ann",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                )
            ],
            {},
        ),
        ([m({"role": "user", "content": "Weather?"})], {"tools": [tool]}),
        (
            [
                m({"role": "system", "content": "S"}),
                m({"role": "user", "content": "Weather?"}),
                m({"role": "assistant", "content": None, "tool_calls": [call]}),
                m({"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}),
                m({"role": "user", "content": "skip"}),
            ],
            {"tools": [tool]},
        ),
    ]


@pytest.mark.parametrize("variant", ["smollm2", "rich", "named", "tool_use_named"])
def test_chat_prompts_equal_transformers(smollm_folder, tmp_path, variant) -> None:
    if variant == "smollm2":
        folder = smollm_folder
    elif variant == "rich":
        folder = _folder_with(tmp_path, smollm_folder, RICH_TEMPLATE)
        (Path(folder) / "chat_template.jinja").unlink(missing_ok=True)
    else:
        named = [{"name": "default", "template": RICH_TEMPLATE.replace("TOOLS", "DEFAULT")}]
        if variant == "tool_use_named":
            named.append({"name": "tool_use", "template": RICH_TEMPLATE})
        folder = _folder_with(tmp_path, smollm_folder, named)
    fast, hf = _pair(folder)
    assert fast.chat_template == hf.chat_template
    ours, theirs = Tokenizer(fast), Tokenizer(hf)
    for messages, kw in _conversations():
        assert ours.render_chat(messages, **kw) == theirs.render_chat(messages, **kw), (variant, messages, kw)
        assert ours.encode_chat(messages, **kw) == theirs.encode_chat(messages, **kw)


def test_template_errors_reach_the_client_as_400(smollm_folder, tmp_path) -> None:
    from gateway.errors import APIError

    ours = Tokenizer(fast_tokenizer.load(_folder_with(tmp_path, smollm_folder, RICH_TEMPLATE)))
    with pytest.raises(APIError) as e:
        ours.render_chat([ChatMessage.model_validate({"role": "user", "content": "bad"})])
    assert e.value.status == 400 and "no bad content" in str(e.value)


def test_the_sandbox_holds(smollm_folder, tmp_path) -> None:
    escape = "{{ messages.__class__.__mro__ }}{% set ns = namespace(_x=1) %}"
    fast = fast_tokenizer.load(_folder_with(tmp_path, smollm_folder, escape))
    with pytest.raises(Exception, match="unsafe|underscore|SecurityError"):
        fast.apply_chat_template([{"role": "user", "content": "x"}])


def test_other_tokenizer_classes_go_to_transformers_where_installed(
    smollm_folder, tmp_path, monkeypatch, caplog
) -> None:
    folder = _folder_with(tmp_path, smollm_folder, None, tokenizer_class="GPT2Tokenizer")
    hf = fast_tokenizer.load(folder)
    assert not isinstance(hf, FastTokenizer) and type(hf).__module__.startswith("transformers")
    # Without transformers (the gateway's image) the fast path serves, and says so.
    monkeypatch.setitem(sys.modules, "transformers", None)
    with caplog.at_level(logging.WARNING, logger="gateway.fast_tokenizer"):
        fast = fast_tokenizer.load(folder)
    assert isinstance(fast, FastTokenizer)
    assert "transformers might differ" in caplog.text
    assert fast.encode(PROSE[:500]) == hf.encode(PROSE[:500])
