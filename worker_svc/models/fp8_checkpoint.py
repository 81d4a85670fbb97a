"""Loading FP8-serialized checkpoints: the formats vLLM loads, detected from config.json.

A checkpoint whose config.json has a `quantization_config` of one of these methods holds its
linear layers' weights in float8_e4m3fn with their scales beside them; they go straight into
the FP8 layers (worker_svc.models.fp8), with no bf16 round trip:

* `compressed-tensors` (llm-compressor's FP8 / FP8_DYNAMIC recipes), format `float-quantized`
  or `naive-quantized`: one config group targeting `Linear`, weights `type: float`, 8 bits,
  symmetric, `strategy: channel` (`weight_scale` [out, 1]) or `tensor` (one scale); `ignore`
  names the modules kept in the model's dtype (exact names or `re:` patterns).
* `fbgemm_fp8` (Meta's FP8 Llama checkpoints): `weight_scale` [out, 1], `modules_to_not_convert`.
* `fp8` (vLLM's `Fp8Config`, AutoFP8's format): one scale per tensor, named `weight_scale` or
  `weight_scale_inv` (a multiplier either way, as in vLLM), `ignored_layers` /
  `modules_to_not_convert`. Block-wise scales (`weight_block_size`) are refused.

A per-tensor scale is broadcast to one per output channel (what the FP8 layers hold), so the
q, k and v of a merged layer keep their own scales exactly: no requantization to a shared one.

Activations: every FP8 layer quantizes its input per token, dynamically, whatever the
checkpoint says. A static per-tensor `input_scale` (compressed-tensors `dynamic: false`, fp8
`activation_scheme: static`) is read and checked (one finite positive number) but not applied:
a token's own scale never clips and is never coarser than a scale shared by every token, so the
result is at least as close to the unquantized model as vLLM's static path, not bit-equal to it.
Likewise fbgemm's `activation_scale_ub` (a cap on a token's scale) is not applied: it only ever
clips outlier tokens. A weight-only checkpoint (no `input_activations`) runs W8A8 too.

What is checked, as the loader checks any checkpoint (safetensors only): every quantized layer's
weight is float8_e4m3fn and has a scale of the declared shape, finite and positive; a layer the
config leaves unquantized (and the embedding, norms and head, which llmesh never quantizes) holds
a float weight; the model's own load_weights then checks names and shapes and that nothing is
missing. KV-cache scales (`k_scale`, `v_scale`) are dropped: `kv_cache_dtype="fp8"` measures its
own (worker_svc/kv_scales.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from torch import nn

log = logging.getLogger(__name__)

METHODS = ("compressed-tensors", "fbgemm_fp8", "fp8")
_CT_FORMATS = ("float-quantized", "naive-quantized")
_FP8 = torch.float8_e4m3fn
_SAFETENSORS_FP8 = "F8_E4M3"
_FLOAT_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_DROPPED = (".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale")


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """What a checkpoint's `quantization_config` declares, in the terms the loader uses."""

    method: str  # one of METHODS
    weight_strategy: Literal["channel", "tensor", "any"]  # the shape of weight_scale
    activations: Literal["dynamic", "static", "none"]  # what the checkpoint asks for (see above)
    ignore: tuple[str, ...]  # module names kept unquantized: exact, a dotted suffix, or "re:..."

    def ignores(self, module: str) -> bool:
        """Whether the Hugging Face module name `module` (e.g. model.layers.0.mlp.down_proj) is
        one the checkpoint keeps unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry):
                return True
        return False


class Fp8CheckpointError(ValueError):
    """A checkpoint's FP8 config or tensors that llmesh cannot load, said plainly."""


def read_scheme(folder: str) -> Fp8Scheme | None:
    """The FP8 scheme of the checkpoint in `folder`, None when its config.json declares no
    quantization; an unsupported one raises Fp8CheckpointError naming what is supported."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        qc = json.load(f).get("quantization_config")
    return None if qc is None else parse_scheme(qc)


def parse_scheme(qc: Any) -> Fp8Scheme:
    """A config.json `quantization_config` -> Fp8Scheme (or Fp8CheckpointError)."""
    if not isinstance(qc, dict):
        raise Fp8CheckpointError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fbgemm_fp8":
        return Fp8Scheme(method, "channel", "dynamic", _names(qc, "modules_to_not_convert"))
    if method == "fp8":
        if qc.get("weight_block_size") is not None:
            raise Fp8CheckpointError(
                f"block-wise FP8 (weight_block_size {qc['weight_block_size']}) is not supported; "
                "llmesh loads per-tensor or per-channel FP8 scales"
            )
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise Fp8CheckpointError(f"fp8 activation_scheme must be dynamic or static, got {scheme!r}")
        ignore = _names(qc, "ignored_layers") + _names(qc, "modules_to_not_convert")
        return Fp8Scheme(method, "any", scheme, ignore)
    raise Fp8CheckpointError(
        f"quantization_config.quant_method {method!r} is not supported; llmesh loads FP8 "
        f"checkpoints of quant_method {', '.join(METHODS)} (or quantizes bf16 weights on load: "
        "quantization='fp8')"
    )


def _names(qc: dict[str, Any], key: str) -> tuple[str, ...]:
    value = qc.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise Fp8CheckpointError(f"quantization_config.{key} must be a list of module names")
    return tuple(value)


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Scheme:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise Fp8CheckpointError(
            f"compressed-tensors: llmesh loads one config group (FP8 for every Linear), got {len(groups)}"
        )
    group = next(iter(groups.values()))
    fmt = group.get("format") or qc.get("format")
    if fmt not in _CT_FORMATS:
        raise Fp8CheckpointError(
            f"compressed-tensors format {fmt!r} is not supported; supported: {_CT_FORMATS}"
        )
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise Fp8CheckpointError(
            f"compressed-tensors targets {targets} are not supported; supported: ['Linear']"
        )
    w = group.get("weights") or {}
    strategy = w.get("strategy")
    if (
        w.get("type") != "float"
        or w.get("num_bits") != 8
        or w.get("symmetric", True) is not True
        or w.get("dynamic", False)
        or w.get("group_size") is not None
        or w.get("block_structure") is not None
        or strategy not in ("channel", "tensor")
    ):
        raise Fp8CheckpointError(
            f"compressed-tensors weights {w} are not supported; supported: type float, num_bits 8, "
            "symmetric, static, strategy channel or tensor"
        )
    return Fp8Scheme(
        "compressed-tensors", strategy, _ct_activations(group.get("input_activations")), _names(qc, "ignore")
    )


def _ct_activations(a: dict[str, Any] | None) -> Literal["dynamic", "static", "none"]:
    if a is None:
        return "none"
    dynamic = a.get("dynamic")
    strategy = a.get("strategy")
    if a.get("type") == "float" and a.get("num_bits") == 8 and a.get("symmetric", True) is True:
        if dynamic is True and strategy == "token":
            return "dynamic"
        if dynamic is False and strategy == "tensor":
            return "static"
    raise Fp8CheckpointError(
        f"compressed-tensors input_activations {a} are not supported; supported: float 8-bit "
        "symmetric, dynamic per token or static per tensor"
    )


def _hf_modules(name: str, layer: nn.Module) -> list[str]:
    """The Hugging Face module names a ShardedLinear of ours stands for: one per segment of a
    merged layer (qkv_proj -> q_proj, k_proj, v_proj), else its own name (under `model.`)."""
    segments = list(layer.segments)  # type: ignore[attr-defined]
    if len(segments) == 1:
        return [f"model.{name}"]
    parent = name.rpartition(".")[0]
    return [f"model.{parent}.{seg}_proj" for seg in segments]


@dataclasses.dataclass
class Fp8Plan:
    """Which layers take FP8 weights from the checkpoint, by their Hugging Face module names."""

    scheme: Fp8Scheme
    quantized: set[str]  # HF module names whose weight is FP8 (and whose scale must come)
    layers: list[nn.Module]  # our layers holding FP8 weights


def prepare_layers(model: nn.Module, scheme: Fp8Scheme) -> Fp8Plan:
    """Give every linear layer the checkpoint quantizes an FP8 weight and a `weight_scale`
    parameter ([out] fp32, so the model's load_weights routes each segment's scale, and TP
    slices, as it does a bias), before the model is allocated (on the meta device: no bf16
    weight is ever allocated for them). `finish_layers` turns the scales into the layers'
    [1, out] buffers once loaded."""
    from worker_svc.models.fp8 import quantizable
    from worker_svc.models.parallel_layers import ShardedLinear

    plan = Fp8Plan(scheme, set(), [])
    for name, layer in model.named_modules():
        if not isinstance(layer, ShardedLinear):
            continue
        modules = _hf_modules(name, layer)
        ignored = [scheme.ignores(m) for m in modules]
        if all(ignored):
            continue
        if any(ignored):
            raise Fp8CheckpointError(
                f"{scheme.method}: the config quantizes some of {modules} and ignores others; llmesh "
                "merges them into one layer, which must be all FP8 or all unquantized"
            )
        if not quantizable(layer):
            raise Fp8CheckpointError(
                f"{modules}: FP8 weights of shape {tuple(layer.weight.shape)} need dims that are "
                "multiples of 16"
            )
        w = layer.weight
        layer.weight = nn.Parameter(torch.empty(w.shape, dtype=_FP8, device=w.device), requires_grad=False)
        layer.weight_scale = nn.Parameter(  # type: ignore[assignment]
            torch.empty(w.shape[0], dtype=torch.float32, device=w.device), requires_grad=False
        )
        plan.quantized.update(modules)
        plan.layers.append(layer)
    if not plan.layers:
        log.warning("%s checkpoint: its config leaves every linear layer unquantized", scheme.method)
    return plan


def finish_layers(plan: Fp8Plan) -> int:
    """The loaded scale parameters become the layers' [1, out] fp32 buffers (as `set_fp8_weight`
    leaves them); returns how many layers hold FP8 weights."""
    for layer in plan.layers:
        scale = layer._parameters.pop("weight_scale")
        assert scale is not None
        layer.register_buffer("weight_scale", scale.data.reshape(1, -1).contiguous(), persistent=False)
    return len(plan.layers)


def checked_tensors(
    weights: Iterable[tuple[str, Any]], plan: Fp8Plan, shapes: dict[str, tuple[int, ...]]
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors, checked against the plan and made what the model loads: FP8
    weights as they are, scales as [out] fp32 (per-tensor ones broadcast), activation and KV
    scales checked and dropped. `shapes`: every tensor's shape, from the files' headers (a
    per-tensor scale is broadcast to its weight's rows, which may come later in the files)."""
    scheme = plan.scheme
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        if name.endswith(_DROPPED):
            continue
        if kind == "input_scale":
            _check_scalar(name, tensor)
            continue
        if kind in ("weight_scale", "weight_scale_inv"):
            if module not in plan.quantized:
                raise Fp8CheckpointError(f"{name}: a scale for {module}, which the config leaves unquantized")
            if kind == "weight_scale_inv" and scheme.method != "fp8":
                raise Fp8CheckpointError(
                    f"{name}: weight_scale_inv belongs to quant_method fp8, not {scheme.method}"
                )
            yield f"{module}.weight_scale", _scale(name, tensor, shapes.get(f"{module}.weight"), scheme)
            continue
        dtype = _dtype_name(tensor)
        if kind == "weight" and module in plan.quantized:
            if dtype != _SAFETENSORS_FP8:
                raise Fp8CheckpointError(
                    f"{name}: {dtype} in a {scheme.method} checkpoint that quantizes {module}; "
                    "expected float8_e4m3fn (F8_E4M3)"
                )
        elif dtype not in _FLOAT_DTYPES.values():
            where = (
                "a module the config leaves unquantized"
                if kind == "weight"
                else "not a weight llmesh quantizes"
            )
            raise Fp8CheckpointError(f"{name}: {dtype} ({where}); expected one of F32, BF16, F16")
        yield name, tensor


def _dtype_name(tensor: Any) -> str:
    """A tensor's (or lazy safetensors slice's) dtype in safetensors' names (F8_E4M3, BF16...)."""
    if isinstance(tensor, torch.Tensor):
        if tensor.dtype == _FP8:
            return _SAFETENSORS_FP8
        return _FLOAT_DTYPES.get(tensor.dtype, str(tensor.dtype))
    return str(tensor.get_dtype())


def _materialize(tensor: Any) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]


def _check_scalar(name: str, tensor: Any) -> torch.Tensor:
    t = _materialize(tensor)
    if t.numel() != 1 or not t.is_floating_point():
        raise Fp8CheckpointError(f"{name}: expected one float scale, got {t.dtype} of shape {tuple(t.shape)}")
    value = float(t.float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise Fp8CheckpointError(f"{name}: scale {value} is not a finite positive number")
    return t


def _scale(name: str, tensor: Any, weight_shape: tuple[int, ...] | None, scheme: Fp8Scheme) -> torch.Tensor:
    """A weight scale as [out] fp32: [out, 1] / [out] per channel, [] / [1] / [1, 1] per tensor."""
    if weight_shape is None:
        raise Fp8CheckpointError(f"{name}: a scale without its weight in the checkpoint")
    t = _materialize(tensor)
    if not t.is_floating_point() or t.dtype == _FP8:
        raise Fp8CheckpointError(f"{name}: scale dtype {t.dtype}; expected F32, BF16 or F16")
    out = weight_shape[0]
    per_tensor = t.numel() == 1 and tuple(t.shape) in ((), (1,), (1, 1))
    per_channel = tuple(t.shape) in ((out, 1), (out,))
    wanted = scheme.weight_strategy
    if (
        (wanted == "tensor" and not per_tensor)
        or (wanted == "channel" and not per_channel)
        or not (per_tensor or per_channel)
    ):
        expected = {"channel": "[out, 1]", "tensor": "[] or [1]", "any": "[out, 1] or [1]"}[wanted]
        raise Fp8CheckpointError(
            f"{name}: scale of shape {tuple(t.shape)} for a weight of {out} rows; "
            f"{scheme.method} ({wanted}) expects {expected}"
        )
    t = t.float().reshape(-1)
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise Fp8CheckpointError(f"{name}: scales must be finite and positive")
    return t.expand(out).contiguous() if per_tensor else t


def header_shapes(files: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the safetensors headers alone (no data read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def describe(plan: Fp8Plan) -> str:
    """One log line on what was loaded and what the loader does differently from the checkpoint."""
    s = plan.scheme
    notes = {
        "static": "; its static input scales are used as dynamic per-token ones",
        "none": "; weight-only in the checkpoint, activations quantized per token here",
        "dynamic": "",
    }[s.activations]
    return f"{s.method} FP8 checkpoint: {len(plan.layers)} linear layers loaded in FP8{notes}"
