"""Writing FP8 checkpoints that vLLM and llmesh load: `llmesh quantize`.

A bf16/fp16/fp32 Hugging Face checkpoint in, an FP8 one out: each decoder linear weight
(`model.layers.N.{self_attn,mlp}.*_proj.weight`, llm-compressor's `Linear` targets less the
head) becomes float8_e4m3fn with one fp32 scale per output channel, `weight_scale` [out, 1],
computed exactly as `quantization="fp8"` does on load (`quantize_weight_fp8`: rows are quantized
independently, so q, k and v quantized apart equal the merged q|k|v quantized at once). Loaded
back, the checkpoint gives the on-the-fly model bit for bit. Everything else (embedding, norms,
head, biases, modules named in `ignore`) is written as it was read.

Formats (config.json's `quantization_config`, as their own tools write it):
* `compressed-tensors`: llm-compressor's FP8_DYNAMIC (weights channel-wise, activations
  dynamic per token), format `float-quantized`, `ignore` = lm_head + `ignore`;
* `fbgemm`: `quant_method: fbgemm_fp8`, `modules_to_not_convert` = lm_head + `ignore`, and
  `activation_scale_ub` 1200 as Meta's checkpoints carry (llmesh does not apply it).

Tensors stream through one at a time (memory: one output shard, at most `_SHARD_BYTES`);
safetensors only, in and out. The tokenizer, generation config and any other non-weight file
of the folder are copied beside.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from worker_svc.loader import iter_safetensors, safetensors_files
from worker_svc.models.fp8 import quantize_weight_fp8
from worker_svc.models.fp8_checkpoint import Fp8Scheme, header_shapes, parse_scheme

FORMATS = ("compressed-tensors", "fbgemm")
_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.[a-z_]+_proj\.weight$")
_SHARD_BYTES = 4 << 30
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


@dataclasses.dataclass
class QuantizeReport:
    """What `quantize_checkpoint` wrote."""

    quantized: int  # linear weights written in FP8
    kept: int  # linear weights kept in their dtype (ignored, or dims not multiples of 16)
    bytes_in: int  # tensor bytes read
    bytes_out: int  # tensor bytes written (scales included)


def quantization_config(fmt: str, ignore: Sequence[str] = ()) -> dict[str, Any]:
    """The config.json `quantization_config` of an llmesh-written FP8 checkpoint."""
    skip = ["lm_head", *ignore]
    if fmt == "fbgemm":
        return {"quant_method": "fbgemm_fp8", "modules_to_not_convert": skip, "activation_scale_ub": 1200.0}
    if fmt != "compressed-tensors":
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**args, "strategy": "channel", "dynamic": False, "observer": "minmax"},
                "input_activations": {**args, "strategy": "token", "dynamic": True, "observer": None},
                "output_activations": None,
            }
        },
        "ignore": skip,
        "kv_cache_scheme": None,
    }


def quantize_checkpoint(
    src: str, out: str, fmt: str = "compressed-tensors", ignore: Sequence[str] = (), progress: bool = True
) -> QuantizeReport:
    """Write the FP8 checkpoint of the model folder `src` into `out` (created; must be empty)."""
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    shapes = header_shapes(safetensors_files(src))
    report = write_fp8_checkpoint(iter_safetensors(src, "cpu"), shapes, config, out, fmt, ignore, progress)
    _copy_other_files(src, out)
    return report


def write_fp8_checkpoint(
    tensors: Iterable[tuple[str, torch.Tensor]],
    shapes: dict[str, tuple[int, ...]],
    config: dict[str, Any],
    out: str,
    fmt: str = "compressed-tensors",
    ignore: Sequence[str] = (),
    progress: bool = True,
) -> QuantizeReport:
    """Write Hugging Face-named `tensors` (of `shapes`, every one's) as an FP8 checkpoint with
    `config` (config.json's content, without a quantization_config) into `out`. The tensors may
    live on the GPU: each is quantized where it is, then copied to the host to be written."""
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method")
        raise ValueError(f"the model is already quantized ({method}); quantize a bf16/fp16/fp32 checkpoint")
    qc = quantization_config(fmt, ignore)
    scheme = parse_scheme(qc)  # the reader's own view of what is written: the two agree
    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"{out} is not empty")
    os.makedirs(out, exist_ok=True)
    targets = _targets(shapes, scheme)
    report = QuantizeReport(0, 0, 0, 0)
    writer = _ShardWriter(out)
    bar = _progress(len(targets), progress)
    for name, tensor in tensors:
        report.bytes_in += tensor.numel() * tensor.element_size()
        if name in targets:
            q, scale = quantize_weight_fp8(tensor)
            writer.add(name, q)
            writer.add(name.removesuffix("weight") + "weight_scale", scale.reshape(-1, 1))
            report.quantized += 1
            bar.update(1)
        else:
            report.kept += bool(_LINEAR.match(name))
            writer.add(name, tensor)
    bar.close()
    report.bytes_out = writer.close()
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**config, "quantization_config": qc}, f, indent=2)
    return report


def hf_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A loaded (size-1, unquantized) model's weights under their Hugging Face names: merged
    layers split back into their segments (qkv_proj -> q_proj, k_proj, v_proj), as
    `load_weights` merged them. For writing a checkpoint of a model built in memory."""
    from worker_svc.models.parallel_layers import ShardedLinear

    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        owner, _, kind = name.rpartition(".")
        layer = modules[owner]
        prefix = "" if name.startswith("lm_head.") else "model."
        if not isinstance(layer, ShardedLinear) or len(layer.segments) == 1:
            yield prefix + name, param.data
            continue
        parent = owner.rpartition(".")[0]
        for seg, piece in zip(layer.segments, param.data.split(list(layer.segments.values())), strict=True):
            yield f"{prefix}{parent}.{seg}_proj.{kind}", piece


def edge_down_proj(num_layers: int) -> list[str]:
    """The opt-in quality recipe (`llmesh quantize --recipe edge-down`): the first and last decoder
    layers' down_proj kept in the model's dtype, as llm-compressor's FP8 recipes often do. On
    SmolLM2-135M it brought the perplexity change on three 1,000-token texts from +1.55 / +4.04 /
    +0.29 % to -0.13 / +1.58 / +0.07 % for 1.6 % more linear-weight bytes; the 8B shape's
    batch-1 step did not move (docs/benchmarks.md, "FP8 checkpoints")."""
    return [f"model.layers.{i}.mlp.down_proj" for i in sorted({0, num_layers - 1})]


def edge_layers(num_layers: int) -> list[str]:
    """The stronger recipe (`--recipe edge-layers`): every projection of the first and last
    decoder layers kept. On SmolLM2-135M the smallest perplexity changes of the recipes tried
    (within 2 % on 6 of 7 texts, against 2 of 7 for all-FP8); ~7 % more linear-weight bytes
    (on the 8B shape 2 of 32 layers in bf16: ~5 % more bytes a decode step reads)."""
    names = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
    return [f"model.layers.{i}.{n}" for i in sorted({0, num_layers - 1}) for n in names]


RECIPES = {"none": lambda num_layers: [], "edge-down": edge_down_proj, "edge-layers": edge_layers}


def is_linear_weight(name: str) -> bool:
    """Whether a Hugging Face tensor name is a decoder projection's weight (what is quantized)."""
    return bool(_LINEAR.match(name))


def _targets(shapes: dict[str, tuple[int, ...]], scheme: Fp8Scheme) -> set[str]:
    """The weights to quantize: decoder linear weights not ignored, with dims that are multiples
    of 16 (the FP8 GEMM's rule; the loader refuses FP8 weights of other shapes)."""
    return {
        name
        for name, shape in shapes.items()
        if _LINEAR.match(name)
        and len(shape) == 2
        and shape[0] % 16 == 0
        and shape[1] % 16 == 0
        and not scheme.ignores(name.removesuffix(".weight"))
    }


class _ShardWriter:
    """Tensors gathered into safetensors shards of about `_SHARD_BYTES`, named as Hugging Face
    names them (model.safetensors alone, else model-0000i-of-0000n.safetensors + an index)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []  # (temporary file, its tensor names)
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor.contiguous().cpu()
        n = tensor.numel() * tensor.element_size()
        self.pending_bytes += n
        self.total += n
        if self.pending_bytes >= _SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = os.path.join(self.out, f".shard-{len(self.shards)}.tmp")
        save_file(self.pending, path, metadata={"format": "pt"})
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> int:
        """Write what is pending, give the shards their final names; returns the bytes written."""
        self._flush()
        n = len(self.shards)
        if n == 1:
            os.replace(self.shards[0][0], os.path.join(self.out, "model.safetensors"))
            return self.total
        weight_map = {}
        for i, (path, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, os.path.join(self.out, final))
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        with open(os.path.join(self.out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
        return self.total


def _copy_other_files(src: str, out: str) -> None:
    """Tokenizer files, generation config, chat template...: every top-level file that is not
    a weight file (pickles are not carried over) nor config.json."""
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if entry == "config.json" or entry.endswith(_WEIGHT_FILES) or not os.path.isfile(path):
            continue
        shutil.copyfile(path, os.path.join(out, entry))


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, show: bool) -> Any:
    """A tqdm bar over the linear layers being quantized (nothing when `show` is off)."""
    if not show:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="fp8: quantizing linear layers", unit="layer")
