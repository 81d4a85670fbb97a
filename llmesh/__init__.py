"""llmesh: the public facade. `from llmesh import LLM, SamplingParams, StructuredOutputs`.

Imports are lazy so that light clients (the gateway, gRPC users of `llmesh.v1`
stubs) do not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmesh.llm import LLM, RequestOutput
    from llmesh.lora import LoRARequest
    from services.sampling_params import SamplingParams
    from services.structured_outputs import StructuredOutputs

__all__ = ["LLM", "LoRARequest", "RequestOutput", "SamplingParams", "StructuredOutputs"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from llmesh import llm

        return getattr(llm, name)
    if name == "LoRARequest":
        from llmesh.lora import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from services.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputs":
        from services.structured_outputs import StructuredOutputs

        return StructuredOutputs
    raise AttributeError(name)
