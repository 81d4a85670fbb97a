"""llmesh: the public facade. `from llmesh import LLM, SamplingParams`.

Imports are lazy so that light clients (the gateway, gRPC users of `llmesh.v1`
stubs) do not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmesh.llm import LLM, RequestOutput
    from services.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from llmesh import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from services.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
