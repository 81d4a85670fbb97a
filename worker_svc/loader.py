"""Building a model from a local folder (or GGUF file): config, weights, fingerprint.

Weights are read from safetensors only (never pickle). The model is first built on the
meta device, then allocated once on the target device in the target dtype, then each
checkpoint tensor is streamed into place: no full random init and no second copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import struct
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn

from services.model_files import resolve_model
from worker_svc.attention.base import AttentionBackend
from worker_svc.models import fp8_checkpoint
from worker_svc.models.config import ModelConfig
from worker_svc.models.fp8 import QUANTIZATIONS
from worker_svc.models.registry import get_model_class
from worker_svc.parallel import TensorParallel, check_shardable

logger = logging.getLogger(__name__)

LoadFormat = Literal["auto", "safetensors", "dummy"]


def load_model(
    path: str | os.PathLike[str] | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
    load_format: LoadFormat = "auto",
    cache_dir: str | None = None,
    num_layers: int = 0,
    tp: TensorParallel | None = None,
    quantization: str | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """(model in eval mode on `device`, its config) for a folder, a .gguf file, or None (default).

    load_format="dummy" fills random weights of the right shapes directly on the device
    (for benchmarks): then `path` only needs a config.json. num_layers > 0 keeps only the
    first decoder layers (with the model's own final norm and head: an early-exit draft model).
    With `tp` of size N this rank's shard is built and only its slices of the checkpoint are
    read; dummy weights are the same at every size (each rank cuts its slice from the size-1
    weights). quantization="fp8": the linear layers' weights are quantized once loaded
    (worker_svc.models.fp8). A checkpoint whose config.json declares FP8 (compressed-tensors,
    fbgemm_fp8, fp8: worker_svc.models.fp8_checkpoint) loads its FP8 weights and scales as they
    are, with quantization None or "fp8".
    """
    if quantization not in (None, *QUANTIZATIONS):
        known = ", ".join(QUANTIZATIONS)
        raise ValueError(f"quantization must be one of {known} or none; got {quantization!r}")
    tp = tp or TensorParallel()
    folder = resolve_model(path, cache_dir)
    config = ModelConfig.from_pretrained(folder)
    if num_layers:
        if num_layers > config.num_layers:
            raise ValueError(f"num_layers {num_layers} exceeds the model's {config.num_layers} layers")
        config = dataclasses.replace(config, num_layers=num_layers)
    check_shardable(config, tp.size)
    if config.sliding_window and config.sliding_window < config.max_position_embeddings:
        logger.warning(
            "%s has a %d-token sliding window that llmesh does not apply: outputs match the reference "
            "only for sequences up to that length",
            config.architecture,
            config.sliding_window,
        )
    if backend is None:
        from worker_svc.attention.torch_paged import TorchPagedBackend

        backend = TorchPagedBackend()
    device = torch.device(device)
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r} (auto, safetensors, dummy)")
    # An FP8-serialized checkpoint (worker_svc.models.fp8_checkpoint) loads its FP8 weights as
    # they are; with dummy weights its config means quantizing them on load.
    scheme = fp8_checkpoint.read_scheme(folder)
    if scheme is not None and quantization not in (None, "fp8"):
        raise ValueError(
            f"{folder} is an FP8 ({scheme.method}) checkpoint; quantization={quantization!r} does not match"
        )
    if scheme is not None and load_format == "dummy":
        scheme, quantization = None, "fp8"
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, backend, tp)
    # Converting dtype on meta is free; to_empty then allocates once, in that dtype.
    model = model.to(dtype)
    plan = fp8_checkpoint.prepare_layers(model, scheme) if scheme is not None else None
    model = model.to_empty(device=device)
    if load_format == "dummy":
        _init_dummy(model)
    else:
        weights = iter_safetensors(folder, device, lazy=tp.size > 1)
        if num_layers:
            weights = ((n, t) for n, t in weights if _layer_of(n) < num_layers)
        if plan is not None:
            shapes = fp8_checkpoint.header_shapes(safetensors_files(folder))
            weights = fp8_checkpoint.checked_tensors(weights, plan, shapes)
        model.load_weights(weights)
    model.eval().requires_grad_(False)
    if plan is not None:
        fp8_checkpoint.finish_layers(plan)
        logger.info("%s", fp8_checkpoint.describe(plan))
    elif quantization is not None:
        from worker_svc.models.fp8 import quantize_model_fp8

        n = quantize_model_fp8(model)
        logger.info("fp8: %d linear layers quantized (W8A8, per-channel weights, per-token activations)", n)
    return model, config


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint's safetensors files: from the shard index when present, else all *.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, name) for name in files]
    files = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))
    if not files:
        pickled = [p for p in os.listdir(folder) if p.endswith((".bin", ".pt", ".pth"))]
        hint = " (pickle checkpoints such as pytorch_model.bin are refused; convert them)" if pickled else ""
        raise FileNotFoundError(f"no .safetensors weights in {folder!r}{hint}")
    return [os.path.join(folder, name) for name in files]


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_of(name: str) -> int:
    """The decoder layer a checkpoint tensor belongs to (-1: none, e.g. the embedding)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else -1


def iter_safetensors(
    folder: str, device: torch.device | str = "cpu", lazy: bool = False
) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor of the checkpoint, one at a time (bounded memory).

    lazy=True yields safetensors slices instead (`get_shape()`, indexing reads only the
    indexed rows): a tensor-parallel rank reads only its share of the bytes.
    """
    from safetensors import safe_open

    device = torch.device(device)
    # safetensors reads straight into GPU memory; "cpu" for anything else it does not know.
    target = str(device) if device.type == "cuda" else "cpu"
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt", device=target) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))


def _init_dummy(model: nn.Module, seed: int = 0) -> None:
    """Random weights in place on the model's device: ones for norms, zeros for biases,
    N(0, 0.02) for matrices (keeps activations bounded through many layers).

    A tensor-parallel shard draws the full (size-1) matrix and keeps its slice, so that every
    size runs the same model."""
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        gen = torch.Generator(device=param.device).manual_seed(seed + len(name))
        if name.endswith(".bias"):
            param.data.zero_()
        elif param.dim() == 1:
            param.data.fill_(1.0)
        else:
            owner, _, param_name = name.rpartition(".")
            module = modules[owner]
            tp = getattr(module, "tp", None)
            if tp is None or tp.size == 1:
                param.data.normal_(0.0, 0.02, generator=gen)
                continue
            full = torch.empty(module.full_shape(param_name), dtype=param.dtype, device=param.device)
            full.normal_(0.0, 0.02, generator=gen)
            param.data.copy_(module.shard_full(param_name, full))
            del full


def model_fingerprint(path: str | os.PathLike[str] | None, cache_dir: str | None = None) -> bytes:
    """A stable 32-byte identity of a model's weights: sha256 (never Python's hash()).

    Covers config.json, each safetensors file's size and header (every tensor's name,
    dtype, shape and offsets) and a fixed sample of its data bytes, so two fine-tunes of
    one architecture differ too, while a multi-GB checkpoint costs only a few MiB of reads.
    """
    folder = resolve_model(path, cache_dir)
    h = hashlib.sha256(b"llmesh-model-fingerprint-v1\0")
    with open(os.path.join(folder, "config.json"), "rb") as f:
        _update_framed(h, f.read())
    try:
        files = safetensors_files(folder)
    except FileNotFoundError:
        files = []  # a config-only folder (dummy weights)
    for file in files:
        size = os.path.getsize(file)
        _update_framed(h, os.path.basename(file).encode())
        _update_framed(h, str(size).encode())
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            _update_framed(h, f.read(header_len))
            data_start = 8 + header_len
            span = size - data_start
            for i in range(_FINGERPRINT_SAMPLES):
                # Evenly spaced windows from the first to the last byte of the tensor data.
                offset = data_start + (span - _FINGERPRINT_WINDOW) * i // (_FINGERPRINT_SAMPLES - 1)
                f.seek(max(offset, data_start))
                _update_framed(h, f.read(_FINGERPRINT_WINDOW))
    return h.digest()


_FINGERPRINT_SAMPLES = 16
_FINGERPRINT_WINDOW = 64 << 10


def _update_framed(h: Any, data: bytes) -> None:
    # Length-prefix each piece so that different splits of the same bytes hash differently.
    h.update(struct.pack("<Q", len(data)))
    h.update(data)
