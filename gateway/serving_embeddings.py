"""POST /v1/embeddings (OpenAI's shape): each input is a pooling request on the scheduler.

An input (a text or token ids; one or a batch) runs as a `Generation` whose sampling
parameters ask for pooling (`SamplingParams.pooling`, the model's default): the scheduler and
workers prefill the prompt, pool its final hidden states and sample nothing, so embeddings share
generation's admission, limits, concurrency cap, disconnect handling and metrics. The vector is
finished here (`services/embeddings.py`): cut to `dimensions`, L2-normalized, as vLLM serves it,
and sent as floats or as base64 of little-endian float32 (what the `openai` client asks for).
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import APIError, bad_request
from gateway.generation import Generation
from gateway.params import Limits, check_prompt_chars, check_token_ids, resolve_max_tokens
from gateway.protocol_embeddings import EmbeddingRequest
from gateway.serving_base import ChoiceResult, Run, raw_prompts
from gateway.state import GatewayState, ServedModel
from services.embeddings import check_dimensions, finish_embedding
from services.sampling_params import SamplingParams

_POOLING = SamplingParams(pooling="default", max_tokens=None)


async def _encode(
    req: EmbeddingRequest, raw: list[str | list[int]], model: ServedModel, limits: Limits
) -> list[list[int]]:
    """Token ids per input; what is cheap to refuse is refused before any tokenizing."""
    if len(raw) > limits.max_prompts:
        raise bad_request("input", f"at most {limits.max_prompts} inputs per request, got {len(raw)}")
    params = ["input" if len(raw) == 1 else f"input[{i}]" for i in range(len(raw))]
    for param, item in zip(params, raw, strict=True):
        if not item:
            raise bad_request(param, "must not be empty")
        if isinstance(item, str):
            check_prompt_chars(param, len(item), limits)
        else:
            check_token_ids(param, item, limits.vocab_size)
    out = []
    for param, item in zip(params, raw, strict=True):  # one at a time: one tokenizer thread each
        ids = (
            await model.tokenizer.encode_async(item, add_special_tokens=req.add_special_tokens)
            if isinstance(item, str)
            else list(item)
        )
        if not ids:
            raise bad_request(param, "encodes to no tokens")
        resolve_max_tokens(len(ids), None, limits, "input", param)  # fits the context
        out.append(ids)
    return out


def _encoded(vec: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    return vec


async def create_embeddings(state: GatewayState, req: EmbeddingRequest, request: Request) -> Response:
    model = state.resolve(req.model)
    name = req.model or model.names[0]
    if model.lora is not None:
        raise bad_request(
            "model", "embeddings with a LoRA adapter are not supported", code="unsupported_parameter"
        )
    limits = state.limits()
    prompts = await _encode(req, raw_prompts(req.input, "input"), model, limits)
    gens = [
        Generation(
            state.client,
            model.tokenizer,
            ids,
            _POOLING,
            model=model.info.id,
            timeout=state.config.request_timeout_s,
            first_index=i,
            priority=req.priority,
        )
        for i, ids in enumerate(prompts)
    ]
    rid, created = f"embd-{uuid.uuid4().hex}", int(time.time())

    def build(results: list[ChoiceResult]) -> dict[str, Any]:
        data = []
        for r in results:
            if r.embedding is None:  # the scheduler ended it otherwise (it reports why as an error)
                raise APIError(500, f"input {r.index} ended ({r.finish_reason}) without its embedding")
            try:
                check_dimensions(req.dimensions, len(r.embedding))
            except ValueError as e:
                raise bad_request("dimensions", str(e)) from None
            vec = finish_embedding(r.embedding, req.dimensions)
            data.append(
                {"object": "embedding", "index": r.index, "embedding": _encoded(vec, req.encoding_format)}
            )
        tokens = sum(len(ids) for ids in prompts)
        return {
            "id": rid,
            "object": "list",
            "created": created,
            "model": name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    return await Run(state, name, gens).respond(request, build, len(gens))
