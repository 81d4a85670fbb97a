"""LoRA adapters in PEFT's format, read without torch: `adapter_config.json` and the
safetensors header of `adapter_model.safetensors` (names, dtypes, shapes; the weights are read
by the worker, `worker_svc.lora.adapter`).

The gateway checks an adapter here before it serves it (`--lora-modules`, `POST
/v1/load_lora_adapter`), so that a bad folder is refused with a 400 instead of failing a
request later; the worker reads the same description before it loads the tensors.

What is served: LoRA (not DoRA) on the attention and MLP projections of a Llama-family model
(q/k/v/o/gate/up/down_proj), bias "none", rank r, lora_alpha, and use_rslora (scale
lora_alpha / sqrt(r) instead of lora_alpha / r). Per-module ranks (`rank_pattern`), embedding
or lm_head adapters and `modules_to_save` are refused with a message that says which.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, by their Hugging Face module names.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's tensor names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
# (some writers keep the adapter's name: ...lora_A.default.weight).
TENSOR_NAME = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$")
MAX_HEADER_BYTES = 100 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


class LoRAConfigError(ValueError):
    """The folder is not an adapter llmesh can serve (the message says why)."""


@dataclass(frozen=True)
class LoRATensor:
    layer: int
    module: str  # q_proj ... down_proj
    which: str  # "A" [r, in] or "B" [out, r]
    shape: tuple[int, ...]
    name: str  # the tensor's name in the file


@dataclass
class LoRAAdapterSpec:
    """An adapter folder's description: what to load and how to scale it."""

    path: str
    r: int
    lora_alpha: float
    use_rslora: bool
    base_model: str
    tensors: list[LoRATensor] = field(default_factory=list)

    @property
    def scale(self) -> float:
        """The factor on B @ A (PEFT's `scaling`)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @property
    def rank(self) -> int:
        """The largest rank of any module (the slot rank it needs)."""
        return max((t.shape[0] for t in self.tensors if t.which == "A"), default=self.r)


def check_lora_name(name: str) -> None:
    """Adapter names are served as model ids: short, printable, no spaces or '='."""
    if not _NAME.match(name):
        raise LoRAConfigError(f"invalid adapter name {name!r}: 1-128 of letters, digits and ._:/@+-")


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """`name=path` items (vLLM's --lora-modules; a JSON object {"name":..., "path":...} too) ->
    {name: path}, in order; a repeated name is an error."""
    out: dict[str, str] = {}
    for item in items:
        item = item.strip()
        if not item:
            continue
        if item.startswith("{"):
            obj = json.loads(item)
            name, path = obj.get("name", ""), obj.get("path", "")
        else:
            name, sep, path = item.partition("=")
            if not sep:
                raise LoRAConfigError(f"--lora-modules takes name=path, got {item!r}")
        name, path = name.strip(), path.strip()
        check_lora_name(name)
        if not path:
            raise LoRAConfigError(f"adapter {name!r}: empty path")
        if name in out:
            raise LoRAConfigError(f"adapter {name!r} given twice")
        out[name] = path
    return out


def read_safetensors_header(file: str) -> dict:
    """The JSON header of a safetensors file (name -> {dtype, shape, data_offsets})."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise LoRAConfigError(f"{file}: not a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > MAX_HEADER_BYTES:
            raise LoRAConfigError(f"{file}: header of {size} bytes")
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise LoRAConfigError(f"{file}: unreadable header ({e})") from None
    header.pop("__metadata__", None)
    return header


def read_lora_spec(path: str) -> LoRAAdapterSpec:
    """Describe the adapter in folder `path`; LoRAConfigError when it cannot be served."""
    cfg_file = os.path.join(path, CONFIG_FILE)
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(cfg_file) or not os.path.isfile(weights):
        raise LoRAConfigError(f"{path}: no {CONFIG_FILE} and {WEIGHTS_FILE} (a PEFT adapter folder)")
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAConfigError(f"{cfg_file}: {e}") from None
    _check_config(cfg_file, cfg)
    spec = LoRAAdapterSpec(
        path=path,
        r=int(cfg["r"]),
        lora_alpha=float(cfg.get("lora_alpha", cfg["r"])),
        use_rslora=bool(cfg.get("use_rslora", False)),
        base_model=str(cfg.get("base_model_name_or_path") or ""),
    )
    for name, info in read_safetensors_header(weights).items():
        m = TENSOR_NAME.search(name)
        if m is None or m.group(3) not in TARGETS:
            raise LoRAConfigError(f"{weights}: tensor {name!r} is not a LoRA of {', '.join(TARGETS)}")
        shape = tuple(int(d) for d in info.get("shape", ()))
        if len(shape) != 2:
            raise LoRAConfigError(f"{weights}: tensor {name!r} has shape {shape}, not a matrix")
        spec.tensors.append(LoRATensor(int(m.group(1)), m.group(3), m.group(4), shape, name))
    if not spec.tensors:
        raise LoRAConfigError(f"{weights}: no LoRA tensors")
    _check_pairs(weights, spec.tensors)
    return spec


def _check_config(cfg_file: str, cfg: dict) -> None:
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAConfigError(f"{cfg_file}: peft_type {peft_type}, only LORA is served")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoRAConfigError(f"{cfg_file}: r must be a positive integer, got {r!r}")
    if cfg.get("use_dora"):
        raise LoRAConfigError(f"{cfg_file}: DoRA adapters are not served")
    if cfg.get("bias", "none") != "none":
        raise LoRAConfigError(f"{cfg_file}: bias {cfg['bias']!r}: only 'none' is served")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoRAConfigError(f"{cfg_file}: {key} (per-module ranks) is not served")
    if cfg.get("modules_to_save"):
        raise LoRAConfigError(f"{cfg_file}: modules_to_save (full extra weights) is not served")
    if cfg.get("fan_in_fan_out"):
        raise LoRAConfigError(f"{cfg_file}: fan_in_fan_out (Conv1D layers) is not served")


def _check_pairs(weights: str, tensors: list[LoRATensor]) -> None:
    seen: dict[tuple[int, str], dict[str, LoRATensor]] = {}
    for t in tensors:
        pair = seen.setdefault((t.layer, t.module), {})
        if t.which in pair:
            raise LoRAConfigError(f"{weights}: two lora_{t.which} tensors for layer {t.layer} {t.module}")
        pair[t.which] = t
    for (layer, module), pair in seen.items():
        if set(pair) != {"A", "B"}:
            raise LoRAConfigError(f"{weights}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = pair["A"].shape, pair["B"].shape
        if a[0] != b[1]:
            raise LoRAConfigError(f"{weights}: layer {layer} {module}: A {a}, B {b}: ranks differ")


_ROOT_TAG = b"llmesh-lora-v1\0"


def lora_cache_root(root: bytes, name: str, path: str) -> bytes:
    """The root of the KV key chain of a request run with adapter (name, path): `root` (its cache
    salt's) for the base model, else a hash of it and the adapter.

    Every block key of the request descends from it (`extend_block_keys`), so an adapter's KV
    is never shared with the base model or with another adapter (or the same name loaded from
    another folder), in a worker's cache, its host tier or the KV store: the same tokens give
    other keys under each adapter. The tag keeps these roots apart from salts' and blocks' keys.
    """
    if not name:
        return root
    h = hashlib.sha256(_ROOT_TAG + root)
    h.update(name.encode("utf-8") + b"\0" + path.encode("utf-8"))
    return h.digest()
