"""OpenAI's /v1/embeddings request body (with vLLM's extras that apply)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.protocol import INT32_MAX, INT32_MIN, Text, _Body


class EmbeddingRequest(_Body):
    model: Text | None = Field(None, description="served model id; default: the first served model")
    input: Text | list[Text] | list[int] | list[list[int]] = Field(
        ..., description="a text, texts, token ids, or lists of token ids"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(
        None, ge=1, le=INT32_MAX, description="keep the first N values (Matryoshka)"
    )
    user: Text | None = None
    # vLLM's extras
    add_special_tokens: bool = True
    priority: int = Field(0, ge=INT32_MIN, le=INT32_MAX, description="lower runs first")
