"""PEFT LoRA adapters made in tests (random low-rank weights, saved as PEFT saves them: no peft
package needed), and the same adapter merged into a copy of the base checkpoint, the reference
a served adapter must match."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence

import torch
from safetensors.torch import load_file, save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


def _module_key(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{_PARENT.get(module, 'mlp')}.{module}"


def make_peft_adapter(
    out_dir: str | os.PathLike[str],
    base_dir: str,
    r: int = 8,
    lora_alpha: float = 16,
    targets: Sequence[str] = ALL_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
    std: float = 0.1,
) -> str:
    """Write adapter_config.json + adapter_model.safetensors for the model in `base_dir`."""
    cfg = json.load(open(os.path.join(base_dir, "config.json")))
    weights = load_file(os.path.join(base_dir, "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module in targets:
            out_f, in_f = weights[_module_key(layer, module) + ".weight"].shape
            prefix = f"base_model.model.{_module_key(layer, module)}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, in_f, generator=gen) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, r, generator=gen) * std
    path = os.fspath(out_dir)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "base_model_name_or_path": base_dir,
        "r": r,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": use_rslora,
        "task_type": "CAUSAL_LM",
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def merge_adapter(base_dir: str, adapter_dir: str, out_dir: str | os.PathLike[str]) -> str:
    """A copy of the base checkpoint with W + scale * B @ A for every adapted module."""
    cfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    r = cfg["r"]
    scale = cfg["lora_alpha"] / (r**0.5 if cfg.get("use_rslora") else r)
    weights = load_file(os.path.join(base_dir, "model.safetensors"))
    lora = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    for name, a in lora.items():
        if ".lora_A." not in name:
            continue
        b = lora[name.replace(".lora_A.", ".lora_B.")]
        key = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[key] = (weights[key].double() + scale * (b.double() @ a.double())).to(weights[key].dtype)
    path = os.fspath(out_dir)
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(base_dir):
        if f != "model.safetensors" and os.path.isfile(os.path.join(base_dir, f)):
            shutil.copy(os.path.join(base_dir, f), path)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path
