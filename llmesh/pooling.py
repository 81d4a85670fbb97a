"""vLLM's pooling outputs for the offline API: `LLM.encode` and `LLM.embed`.

A pooling request runs through the same engine as generation (`SamplingParams.pooling`): the
prompt is prefilled, its final hidden states pooled on the worker, nothing sampled, its KV
blocks freed. `encode` hands back the raw pooled vector, `embed` the embedding (cut to
`dimensions`, normalized unless told otherwise), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.sampling_params import SamplingParams


@dataclass
class PoolingParams:
    """vLLM's `PoolingParams` (the parts that apply): how to pool, and how to finish the vector."""

    pooling_type: str = "default"  # default (the model's), last, mean, cls
    dimensions: int | None = None  # embed: keep the first `dimensions` values (Matryoshka)
    normalize: bool | None = None  # embed: L2-normalize (None = yes); encode never does

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(pooling=self.pooling_type, max_tokens=None)


@dataclass
class PoolingOutput:
    data: list[float]


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    prompt: str | None = field(default=None, repr=False)
