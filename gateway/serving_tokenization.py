"""POST /tokenize and /detokenize (vLLM's routes), under the same size limits as generation.

Tokenizing costs the gateway about 1 s and ~100 MiB per MB of text: without the limits that
completions apply, a few large bodies would stall it and take gigabytes. So the text of a
prompt (or of a conversation) is refused, without tokenizing it, past the characters the
model's context could ever hold (`Limits.prompt_chars`), and a detokenized sequence may be at
most the context length; the errors are completions' own (400, `context_length_exceeded`).
The request body itself is capped by the guard middleware for every route alike (413).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import bad_request
from gateway.params import check_prompt_chars, check_token_ids
from gateway.protocol import DetokenizeRequest, TokenizeRequest
from gateway.state import GatewayState, ServedModel
from gateway.tokenizer import chat_chars


async def _encode_messages(model: ServedModel, body: TokenizeRequest) -> list[int]:
    messages = body.messages or []
    if not messages:
        raise bad_request("messages", "must not be empty")
    # As chat completions: the template only adds to the messages' text.
    check_prompt_chars("messages", chat_chars(messages), model.limits)
    return await model.tokenizer.encode_chat_async(
        messages,
        add_special_tokens=bool(body.add_special_tokens),
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )


async def _encode_prompt(model: ServedModel, body: TokenizeRequest) -> list[int]:
    prompt = body.prompt or ""
    check_prompt_chars("prompt", len(prompt), model.limits)
    add = True if body.add_special_tokens is None else body.add_special_tokens
    return await model.tokenizer.encode_async(prompt, add_special_tokens=add)


async def tokenize(state: GatewayState, body: TokenizeRequest) -> dict[str, Any]:
    """Token ids of a prompt or of a rendered conversation (a count over the context is reported,
    not refused, as vLLM does: measuring a prompt is what the route is for)."""
    model = state.resolve(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("prompt", "give exactly one of prompt and messages")
    if body.messages is not None:
        ids = await _encode_messages(model, body)
    else:
        ids = await _encode_prompt(model, body)
    return {"count": len(ids), "max_model_len": model.info.max_model_len, "tokens": ids}


async def detokenize(state: GatewayState, body: DetokenizeRequest) -> dict[str, Any]:
    """Text of token ids: at most a context's worth (no sequence is longer), checked before decoding."""
    model = state.resolve(body.model)
    limit = model.limits.max_model_len
    if len(body.tokens) > limit:
        raise bad_request(
            "tokens",
            f"{len(body.tokens)} tokens, but this model's maximum context length is {limit} tokens",
            code="context_length_exceeded",
        )
    check_token_ids("tokens", body.tokens, model.info.vocab_size)
    return {"prompt": await model.tokenizer.decode_async(body.tokens)}
