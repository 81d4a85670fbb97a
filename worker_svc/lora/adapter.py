"""A PEFT adapter's A/B matrices read from its safetensors file (CPU, fp32), by layer and module.

The file is read with safetensors (never pickle); names and shapes were checked by
`services.lora_config.read_lora_spec`, which also gives the scale folded into B on load.
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from services.lora_config import WEIGHTS_FILE, LoRAAdapterSpec


def read_adapter_tensors(spec: LoRAAdapterSpec) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """{(layer, module): (A [r, in], B [out, r])} in fp32."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(os.path.join(spec.path, WEIGHTS_FILE), framework="pt", device="cpu") as f:
        for t in spec.tensors:
            pairs.setdefault((t.layer, t.module), {})[t.which] = f.get_tensor(t.name).float()
    return {key: (p["A"], p["B"]) for key, p in pairs.items()}
