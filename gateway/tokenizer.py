"""The gateway's view of the model's tokenizer: encoding, chat templates, per-token text for logprobs.

Tokenizing a large prompt takes seconds (about 1 s per MB of text): done on the
event loop it would stall every stream the gateway serves. Inputs above
`INLINE_TOKENIZE_CHARS` run in the gateway's tokenizer threads (HF fast tokenizers
release the GIL while the Rust encoder runs); small ones stay inline, where a
thread hop would cost more than the work.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from gateway.errors import APIError, bad_request
from gateway.protocol import ChatMessage, Tool
from services.limits import INLINE_TOKENIZE_CHARS, longest_token_chars

T = TypeVar("T")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable char each byte was mapped to -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def message_text(msg: ChatMessage, index: int) -> str:
    """A message's content as one string (templates take strings); only text parts exist here."""
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    parts = []
    for j, part in enumerate(msg.content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages[{index}].content[{j}]",
                f"only text parts are supported, got type {part.type!r}",
            )
        parts.append(part.text)
    return "\n".join(parts)


def chat_chars(messages: list[ChatMessage]) -> int:
    """Characters of text in a conversation: what the template will wrap, known without rendering it."""
    return sum(len(message_text(m, i)) for i, m in enumerate(messages))


# SmolLM2's own function-calling prompt (its model card): used for templates that do not render
# tools themselves, so that the model sees them in the format it was tuned on.
TOOLS_SYSTEM_PROMPT = """You are an expert in composing functions. You are given a question and a set of \
possible functions. Based on the question, you will need to make one or more function/tool calls to \
achieve the purpose. If none of the functions can be used, point it out and refuse to answer. If the \
given question lacks the parameters required by the function, also point it out.

You have access to the following tools:
<tools>{tools}</tools>

The output MUST strictly adhere to the following format, and NO other text MUST be included.
The example format is as follows. Please make sure the parameter type is correct. If no function call \
is needed, please make the tool calls an empty list '[]'.
<tool_call>[
{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},
... (more tool calls as required)
]</tool_call>"""


def _tool_json(tools: list[Tool]) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in tools]


def _calls_json(msg: ChatMessage) -> list[dict[str, Any]]:
    """An assistant's earlier calls as chat templates take them (arguments as objects)."""
    out = []
    for c in msg.tool_calls or []:
        try:
            args: Any = json.loads(c.function.arguments)
        except ValueError:
            args = c.function.arguments
        out.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
    return out


class Tokenizer:
    def __init__(self, hf: Any, executor: Executor | None = None) -> None:
        self.hf = hf
        self.executor = executor  # None = the event loop's default executor
        decoder = getattr(getattr(hf, "backend_tokenizer", None), "decoder", None)
        # Byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen): token pieces spell raw bytes in a
        # printable alphabet, so a token's exact bytes (half a UTF-8 character included) are known.
        self._byte_level = type(decoder).__name__ == "ByteLevel"

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """Characters of the longest token (a vocabulary walk: warm it off the event loop, once)."""
        return longest_token_chars(self.hf)

    async def off_loop(self, size: int, fn: Callable[[], T]) -> T:
        """`fn()` inline when its input (`size` characters) is small, else in a tokenizer thread."""
        if size <= INLINE_TOKENIZE_CHARS:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.off_loop(len(text), functools.partial(self.encode, text, add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[Tool] | None = None,
    ) -> str:
        """The prompt text of a conversation, by the model's own chat template.

        Tools (and earlier tool calls) go to the template; a template that ignores them (the
        embedded SmolLM2's) gets them the way SmolLM2 was tuned on: a system prompt listing
        them, calls written as `<tool_call>[...]</tool_call>`.
        """
        template = getattr(self.hf, "chat_template", None)
        if not template:
            raise APIError(400, "This model has no chat template; use /v1/completions.", param="messages")
        if continue_final_message and add_generation_prompt:
            raise bad_request("continue_final_message", "cannot be combined with add_generation_prompt=true")
        if continue_final_message and messages[-1].role != "assistant":
            raise bad_request("continue_final_message", "the last message must be the assistant's")
        knows_tools = isinstance(template, str) and "tools" in template
        knows_calls = isinstance(template, str) and "tool_calls" in template
        conv = []
        for i, m in enumerate(messages):
            item: dict[str, Any] = {"role": m.role, "content": message_text(m, i)}
            if m.name:
                item["name"] = m.name
            if m.tool_calls:
                calls = _calls_json(m)
                if knows_calls:
                    item["tool_calls"] = calls
                else:
                    listed = [c["function"] for c in calls]
                    item["content"] += f"<tool_call>{json.dumps(listed, ensure_ascii=False)}</tool_call>"
            if m.tool_call_id:
                item["tool_call_id"] = m.tool_call_id
            conv.append(item)
        kw: dict[str, Any] = {}
        if tools and knows_tools:
            kw["tools"] = _tool_json(tools)
        elif tools:
            prompt = TOOLS_SYSTEM_PROMPT.format(tools=json.dumps(_tool_json(tools), ensure_ascii=False))
            if conv and conv[0]["role"] == "system":
                conv[0] = {**conv[0], "content": conv[0]["content"] + "\n\n" + prompt}
            else:
                conv.insert(0, {"role": "system", "content": prompt})
        try:
            # tokenize=False: in transformers 5 tokenize=True returns a BatchEncoding.
            return self.hf.apply_chat_template(
                conv,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **kw,
            )
        except Exception as e:  # a template's raise_exception(): the conversation is at fault
            raise bad_request("messages", f"the chat template rejected the conversation: {e}") from e

    def encode_chat(
        self, messages: list[ChatMessage], add_special_tokens: bool = False, **kw: Any
    ) -> list[int]:
        # The template already wrote BOS and the like; adding special tokens would double them.
        return self.encode(self.render_chat(messages, **kw), add_special_tokens=add_special_tokens)

    async def encode_chat_async(
        self, messages: list[ChatMessage], add_special_tokens: bool = False, **kw: Any
    ) -> list[int]:
        """Render and encode; a large conversation does both (jinja included) in a tokenizer thread."""
        fn = functools.partial(self.encode_chat, messages, add_special_tokens, **kw)
        # Each message is also a loop of the template: thousands of empty ones are work too.
        size = chat_chars(messages) + sum(len(m.name or "") + 32 for m in messages)
        return await self.off_loop(size, fn)

    async def decode_async(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # A token is a few characters: size the work as if each were one.
        return await self.off_loop(len(ids), functools.partial(self.decode, ids, skip_special_tokens))

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one Tokenizer per process, bounded
    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (for logprobs' `bytes`)."""
        if self._byte_level:
            piece = self.hf.convert_ids_to_tokens(token_id)
            table = _byte_decoder()
            if piece is not None and all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            if piece is not None:
                return piece.encode()  # added / special tokens are stored as plain text
        return self.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        """A token as text for logprobs; a partial UTF-8 character shows as U+FFFD, as in vLLM."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")
