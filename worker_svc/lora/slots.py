"""The worker's LoRA slots: up to `max_loras` adapters on the device at once, loaded on demand.

A new sequence that names an adapter takes a reference on its slot (`acquire`), loading the
adapter first if no slot holds it: into a slot never used, else into the least recently used
slot that no live sequence holds. The scheduler never runs more distinct adapters on a worker
than it has slots (`WorkerInfo.max_loras`), so a slot is always found; a plan that breaks this
is refused (ValueError). Loading copies into the stacked tensors on the current stream, after
the work of any step still in flight that read the slot's old adapter.

A slot is named by the adapter's (name, path): loading another folder under a known name is
another adapter (the scheduler keys the prefix cache the same way).

Each step, `batch_arrays` turns the rows' slots into the sorted row list the kernels read; a
step whose rows all run the base model gets None, and the layers then do nothing.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from services.lora_config import parse_lora_modules, read_lora_spec
from worker_svc.lora.adapter import read_adapter_tensors
from worker_svc.lora.layer import BatchRef, LoRABatch, LoRALayer
from worker_svc.models.parallel_layers import ShardedLinear

log = logging.getLogger(__name__)

# Hugging Face projection -> (our fused module under the layer, its segment).
_MODULES = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", "gate"),
    "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", None),
}

Key = tuple[str, str]  # (name, path)


class LoRASlots:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.ref = BatchRef()
        self.layers: dict[str, LoRALayer] = {}
        for name, module in model.named_modules():
            if isinstance(module, ShardedLinear):
                layer = LoRALayer(module, max_loras, max_rank, dtype, self.ref)
                module.lora = layer
                self.layers[name.removeprefix("model.")] = layer
        self._loaded: OrderedDict[Key, int] = OrderedDict()  # least recently used first
        # Called (slot, folder) after each load on demand: rank 0 tells the other tensor-parallel
        # ranks to load the same folder into the same slot (worker_svc/runner.py).
        self.on_load: Callable[[int, str], None] | None = None
        self._refs = [0] * max_loras
        self._free = list(range(max_loras - 1, -1, -1))

    @property
    def loaded(self) -> list[Key]:
        return list(self._loaded)

    def acquire(self, name: str, path: str) -> int:
        """The slot holding adapter (name, path), loaded if needed, with one more reference."""
        key = (name, path)
        slot = self._loaded.get(key)
        if slot is None:
            slot = self._take_slot()
            try:
                self._load(slot, path)
            except BaseException:
                self._free.append(slot)
                raise
            self._loaded[key] = slot
            if self.on_load is not None:
                self.on_load(slot, path)
            log.info("lora adapter loaded", extra={"adapter": name, "path": path, "slot": slot})
        self._loaded.move_to_end(key)
        self._refs[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        if slot >= 0:
            self._refs[slot] -= 1

    def preload(self, name: str, path: str) -> None:
        """Load an adapter now (a --lora-modules entry), unreferenced: the first to go if slots run out."""
        if self._free:
            self.release(self.acquire(name, path))

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        for key, slot in self._loaded.items():  # least recently used first
            if self._refs[slot] == 0:
                del self._loaded[key]
                return slot
        raise ValueError(f"every one of the {self.max_loras} LoRA slots is held by a running sequence")

    def load_into(self, slot: int, path: str) -> None:
        """Another tensor-parallel rank: load what rank 0 loaded into `slot` (its own shard of it)."""
        self._load(slot, path)

    def _load(self, slot: int, path: str) -> None:
        spec = read_lora_spec(path)
        if spec.rank > self.max_rank:
            raise ValueError(f"adapter {path}: rank {spec.rank} exceeds max_lora_rank {self.max_rank}")
        tensors = read_adapter_tensors(spec)
        for layer in self.layers.values():
            layer.clear(slot)
        for (index, module), (a, b) in tensors.items():
            ours, segment = _MODULES[module]
            layer = self.layers.get(f"layers.{index}.{ours}")
            if layer is None:
                raise ValueError(f"adapter {path}: the model has no layer {index} {module}")
            try:
                layer.load(slot, segment, a, b, spec.scale)
            except ValueError as e:
                raise ValueError(f"adapter {path}: layer {index} {module}: {e}") from None

    # ----- per step -----
    def batch_arrays(self, token_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, int] | None:
        """(perm, starts, max rows of a slot) for the rows' slots (-1: base), None if no row uses one."""
        return lora_batch_arrays(token_slots, self.max_loras)

    def set_batch(self, batch: LoRABatch | None) -> None:
        self.ref.batch = batch


def lora_batch_arrays(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray, int] | None:
    """The kernels' row list: rows using an adapter sorted by slot (stable), and each slot's start."""
    used = token_slots >= 0
    if not used.any():
        return None
    order = np.argsort(token_slots, kind="stable")
    perm = order[token_slots[order] >= 0]
    counts = np.bincount(token_slots[perm], minlength=num_slots)
    starts = np.zeros(num_slots + 1, dtype=np.int32)
    np.cumsum(counts, out=starts[1:])
    return perm.astype(np.int32), starts, int(counts.max())


def make_lora_slots(config, model: nn.Module, dtype: torch.dtype) -> LoRASlots | None:  # type: ignore[no-untyped-def]
    """The worker's slots when it serves LoRA (`WorkerConfig.lora_enabled`), its --lora-modules
    loaded (on every tensor-parallel rank alike, in order: into the same slots)."""
    if not config.lora_enabled():
        return None
    slots = LoRASlots(model, config.max_loras, config.max_lora_rank, dtype)
    for name, path in parse_lora_modules(config.lora_modules).items():
        slots.preload(name, path)
    return slots


def encode_lora_load(slot: int, path: str) -> list[np.ndarray]:
    """A LORA_LOAD rank message's arrays (the channel carries integers: the folder's UTF-8 bytes)."""
    folder = np.frombuffer(path.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    return [np.array([slot], dtype=np.int64), folder]


def decode_lora_load(arrays: list[np.ndarray]) -> tuple[int, str]:
    return int(arrays[0][0]), arrays[1].astype(np.uint8).tobytes().decode("utf-8")
