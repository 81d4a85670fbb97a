"""The LoRA adapters a gateway serves as models: `--lora-modules name=path`, and vLLM's runtime
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter` (with
`--allow-runtime-lora-updating`, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).

A request whose `model` names an adapter runs the served model with it: the gateway sends the
adapter's name and folder with the request (GenerateRequest.lora_name / lora_path) and the
workers load it on demand. Each adapter is checked here before it is served (its config and
safetensors header, `services.lora_config`): a bad or missing one is a 400 now, not a failure
of the requests that would name it. So the gateway (and the scheduler, which checks again)
must see the adapters at the workers' paths: one host, or a volume shared by the pods.

The registry is this gateway process's: with --api-server-count > 1 or several replicas, adapters
loaded at run time are known to the process that took the call only; --lora-modules are known
to all of them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from gateway.errors import APIError
from services.lora_config import LoRAConfigError, check_lora_name, parse_lora_modules, read_lora_spec


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str


def check_adapter(name: str, path: str) -> None:
    """LoRAConfigError unless `name` is valid and `path` a servable adapter folder on this host."""
    check_lora_name(name)
    if not path:
        raise LoRAConfigError("lora_path is empty")
    read_lora_spec(path)


class LoRARegistry:
    def __init__(self, modules: list[str]) -> None:
        self._adapters: dict[str, LoRAModule] = {}
        for name, path in parse_lora_modules(modules).items():
            check_adapter(name, path)  # at startup: a bad --lora-modules entry stops the gateway
            self._adapters[name] = LoRAModule(name, path)

    def get(self, name: str) -> LoRAModule | None:
        return self._adapters.get(name)

    @property
    def adapters(self) -> list[LoRAModule]:
        return list(self._adapters.values())

    async def load(self, name: str, path: str, served_names: list[str]) -> LoRAModule:
        """vLLM's load_lora_adapter: 400 for a name taken (by an adapter or the model) or a bad folder."""
        if name in served_names:
            raise APIError(400, f"The lora adapter '{name}' would shadow a served model.", param="lora_name")
        if name in self._adapters:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        try:
            await asyncio.to_thread(check_adapter, name, path)
        except (LoRAConfigError, OSError) as e:
            raise APIError(
                400, f"The lora adapter '{name}' cannot be loaded: {e}", param="lora_path"
            ) from None
        module = self._adapters[name] = LoRAModule(name, path)
        return module

    def unload(self, name: str) -> None:
        """vLLM's unload_lora_adapter: 404 for an adapter not loaded. Requests running with it finish;
        workers drop it from their slots when slots are needed."""
        if self._adapters.pop(name, None) is None:
            raise APIError(
                404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found"
            )


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/unload_lora_adapter (lora_int_id is accepted and unused)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_int_id: int | None = None


def adapter_card(module: LoRAModule, parent: str, created: int) -> dict:
    """An adapter's /v1/models entry, as vLLM lists them: its folder as root, the model as parent."""
    return {
        "id": module.name,
        "object": "model",
        "created": created,
        "owned_by": "llmesh",
        "root": module.path,
        "parent": parent,
        "max_model_len": None,
    }
