"""Request bodies of the OpenAI API (and vLLM's extensions), as pydantic models.

The models check types and static ranges (so that /openapi.json documents
them); limits that depend on configuration or on the model (caps on n, stop,
logprobs; the context length; the vocabulary) are checked by gateway/params.py.
Unknown fields are ignored, as vLLM does, so that clients sending newer
OpenAI fields keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from gateway.cache_salt import MAX_CACHE_SALT_BYTES, check_cache_salt

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Logprobs are clamped to this in responses (as vLLM does): -inf has no JSON spelling.
LOGPROB_FLOOR = -9999.0


def _valid_unicode(text: str) -> str:
    # JSON may carry lone surrogates ("\\ud800"); they cannot be tokenized nor encoded as UTF-8.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogate code points)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
CacheSalt = Annotated[str, AfterValidator(_valid_unicode), AfterValidator(check_cache_salt)]


class _Body(BaseModel):
    # NaN / Infinity are valid Python JSON but never a valid sampling value.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    name: Text = "response"
    description: Text | None = None
    # `schema` shadows a BaseModel attribute: stored as json_schema, spelled "schema" in JSON.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(_Body):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None


class SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = Field(None, description="served model id; default: the first served model")
    n: int = Field(1, ge=1, description="choices to generate")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1 or 0 = all tokens")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = Field(None, description="not supported: must be empty")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    priority: int = Field(0, ge=INT32_MIN, le=INT32_MAX, description="lower runs first")
    cache_salt: CacheSalt | None = Field(
        None,
        description="prefix-cache isolation (vLLM's): requests share cached prompt blocks only with "
        f"requests of the same salt; non-empty, at most {MAX_CACHE_SALT_BYTES} bytes of UTF-8",
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older names for structured_outputs' fields.
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None


class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]] = Field(
        ..., description="text, texts, token ids, or lists of token ids"
    )
    # 0 with echo: the prompt alone, with its logprobs (vLLM; lm-evaluation-harness scores so).
    max_tokens: int | None = Field(16, ge=0, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    # vLLM's extra: each choice's `prompt_logprobs` ({token id: logprob, rank, decoded_token}).
    prompt_logprobs: int | None = Field(None, ge=0)
    suffix: Text | None = Field(None, description="not supported")
    best_of: int | None = Field(None, ge=1, description="only best_of == n is supported")


class ContentPart(_Body):
    type: Text
    text: Text | None = None


class FunctionCall(_Body):
    name: Text
    arguments: Text = "{}"  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: which call it answers


class FunctionDefinition(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(_Body):
    name: Text


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="deprecated by OpenAI")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_Body):
    """Exactly one of `prompt` (text) and `messages` (rendered with the chat template)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(None, description="default: true for prompt, false for messages")
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[int]
