"""What the scheduler knows of a worker's LoRA slots: how many, and which adapters it ran last.

A worker holds `WorkerInfo.max_loras` adapters on its device at once and loads one when a new
sequence names it (least recently used out, among slots no live sequence holds). The planner
keeps the worker within that: a waiting request whose adapter would be one too many among the
running ones waits (vLLM's scheduler does the same), while requests of adapters that fit are
admitted past it. The router prefers a worker that ran the adapter lately (its slot is likely
still loaded: no load on the step), mirrored here as an LRU of the adapters sent to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from services.lora_config import LoRAConfigError, check_lora_name, read_lora_spec

LoRAKey = tuple[str, str]  # (name, path); ("", "") = the base model


class HasLoRA(Protocol):
    lora_name: str
    lora_path: str


def lora_key(req: HasLoRA) -> LoRAKey | None:
    return (req.lora_name, req.lora_path) if req.lora_name else None


class LoRAMirror:
    def __init__(self, max_loras: int = 0) -> None:
        self.max_loras = max_loras
        self._recent: OrderedDict[LoRAKey, None] = OrderedDict()

    def touch(self, req: HasLoRA) -> None:
        """A new sequence with this adapter went to the worker: it holds the adapter now."""
        key = lora_key(req)
        if key is None:
            return
        self._recent[key] = None
        self._recent.move_to_end(key)
        while len(self._recent) > self.max_loras:
            self._recent.popitem(last=False)

    def holds(self, key: LoRAKey | None) -> bool:
        return key is not None and key in self._recent

    def fits(self, req: HasLoRA, running: Iterable[HasLoRA]) -> bool:
        """Whether `req` may join `running` on the worker without more adapters than slots."""
        key = lora_key(req)
        if key is None:
            return True
        live = {k for k in map(lora_key, running) if k is not None}
        return key in live or len(live) < self.max_loras


class LoRAChecks:
    """The scheduler's check of the adapters requests name (GenerateRequest.lora_name/lora_path),
    remembering the folders found servable (a bounded LRU: one read per adapter, not per request)."""

    def __init__(self, max_remembered: int = 256) -> None:
        self._servable: OrderedDict[LoRAKey, int] = OrderedDict()  # -> the adapter's rank
        self._max = max_remembered

    def check(self, name: str, path: str, max_rank: int = 0) -> None:
        """ValueError (its message starts with the field) unless (name, path) may go to workers.

        The folder is read here (its config and safetensors header): a bad or missing adapter is
        refused before any worker tries it, since a load that fails on a worker ends its Step
        stream. So the scheduler must see the adapters at the workers' paths (one host, or a
        shared volume). `max_rank`: the workers' max_lora_rank (0: not checked)."""
        if not name and not path:
            return
        if not name or not path:
            raise ValueError("lora_name: lora_name and lora_path go together")
        key = (name, path)
        rank = self._servable.get(key)
        if rank is None:
            try:
                check_lora_name(name)
                rank = read_lora_spec(path).rank
            except (LoRAConfigError, OSError) as e:
                raise ValueError(f"lora_name: {e}") from None
            self._servable[key] = rank
            while len(self._servable) > self._max:
                self._servable.popitem(last=False)
        self._servable.move_to_end(key)
        if max_rank and rank > max_rank:
            raise ValueError(
                f"lora_name: adapter {name!r} has rank {rank}, above the workers' max_lora_rank {max_rank}"
            )
