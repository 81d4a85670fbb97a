"""`LoRARequest`: which LoRA adapter an offline request runs with (vLLM's class and fields).

`LLM(model, enable_lora=True).generate(prompts, params, lora_request=LoRARequest("sql", 1,
"/adapters/sql"))` runs the prompts with the PEFT adapter in that folder; a list gives one per
prompt (None: the base model). The worker loads an adapter into one of its `max_loras` slots the
first time a request names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.lora_config import check_lora_name, read_lora_spec


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # vLLM's unique id; llmesh names an adapter by (lora_name, lora_path)
    lora_path: str

    def check(self, max_rank: int = 0) -> None:
        """ValueError unless the name is valid and the folder an adapter of rank <= `max_rank` (0:
        any) that can be served."""
        check_lora_name(self.lora_name)
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be positive, got {self.lora_int_id}")
        rank = read_lora_spec(self.lora_path).rank
        if max_rank and rank > max_rank:
            raise ValueError(
                f"LoRA adapter {self.lora_name!r} has rank {rank}, above max_lora_rank {max_rank}"
            )


def lora_requests_for(
    num_prompts: int,
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    max_loras: int = 0,
    max_rank: int = 0,
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, each checked (ValueError) before anything runs, against
    the engine's max_loras (0: LoRA is off) and max_lora_rank."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        loras: list[LoRARequest | None] = [lora_request] * num_prompts
    else:
        loras = list(lora_request)
        if len(loras) != num_prompts:
            raise ValueError(f"{len(loras)} lora requests for {num_prompts} prompts")
    checked: set[LoRARequest] = set()
    for lora in loras:
        if lora is not None and lora not in checked:
            if not isinstance(lora, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
            if not max_loras:
                raise ValueError("lora_request needs LoRA on: LLM(..., enable_lora=True)")
            lora.check(max_rank)
            checked.add(lora)
    return loras
