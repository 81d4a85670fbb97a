"""The gateway's adapters: --lora-modules parsed and checked at start (a bad entry stops it),
runtime loads refused for a taken name or a folder that is no adapter, unloads of unknown names
404; and `llmesh up`/`serve --lora-modules` handing the same list to the gateway and workers."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import APIError
from gateway.lora import LoRARegistry
from llmesh.cli import parse_command, up_kwargs
from services.lora_config import LoRAConfigError, parse_lora_modules


def _adapter(tmp_path, name: str = "a") -> str:
    import json

    import numpy as np
    from safetensors.numpy import save_file

    path = tmp_path / name
    path.mkdir()
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {
            f"{prefix}.lora_A.weight": np.zeros((4, 8), np.float32),
            f"{prefix}.lora_B.weight": np.zeros((8, 4), np.float32),
        },
        str(path / "adapter_model.safetensors"),
    )
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    return str(path)


def test_modules_are_parsed_as_vllm_takes_them() -> None:
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == {"a": "/x", "b": "/y"}
    for bad in (["a"], ["a=/x", "a=/y"], ["bad name=/x"], ["a="]):
        with pytest.raises(LoRAConfigError):
            parse_lora_modules(bad)


def test_registry_checks_what_it_serves(tmp_path) -> None:
    good = _adapter(tmp_path)
    reg = LoRARegistry([f"a={good}"])
    assert [m.name for m in reg.adapters] == ["a"]
    for bad in (f"x={tmp_path}", "x=/not/on/this/host"):  # no adapter there: the gateway stops
        with pytest.raises(LoRAConfigError):
            LoRARegistry([bad])

    async def run() -> None:
        with pytest.raises(APIError) as e:
            await reg.load("a", good, ["model"])
        assert e.value.status == 400 and "already been loaded" in e.value.message
        with pytest.raises(APIError) as e:
            await reg.load("model", good, ["model"])
        assert e.value.status == 400
        with pytest.raises(APIError) as e:
            await reg.load("c", str(tmp_path), ["model"])
        assert e.value.status == 400 and e.value.param == "lora_path"
        assert (await reg.load("c", good, ["model"])).path == good

    asyncio.run(run())
    reg.unload("c")
    with pytest.raises(APIError) as e:
        reg.unload("c")
    assert e.value.status == 404


def test_up_hands_lora_modules_to_the_gateway_and_workers() -> None:
    args = parse_command(["serve", "m", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2"])
    kw = up_kwargs(args)
    assert kw["gateway_args"][kw["gateway_args"].index("--lora-modules") + 1] == "a=/x,b=/y"
    assert kw["worker_args"][kw["worker_args"].index("--lora-modules") + 1] == "a=/x,b=/y"
    assert "--max-loras" in kw["worker_args"]
