"""The scheduler's exact mirror of one worker's host (CPU) KV tier: which block key sits in which slot.

The worker's host tier is a pool of slots, each holding one KV block. The
scheduler picks every slot a plan saves to or loads from, so it knows the
tier's contents without asking (vLLM's CPU offloading splits the same way: a
scheduler-side manager, a worker-side copier). Eviction is least recently used;
slots that the plan being built loads from are pinned so that the same plan
never saves over them.
"""

from __future__ import annotations

from collections import OrderedDict


class HostBlockIndex:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recent first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self.num_saved = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def leading_run(self, keys: list[bytes]) -> list[int]:
        """Slots of the longest run of leading `keys` present (touched: they are about to be used)."""
        slots = []
        for key in keys:
            slot = self._slots.get(key)
            if slot is None:
                break
            self._slots.move_to_end(key)
            slots.append(slot)
        return slots

    def count_run(self, keys: list[bytes]) -> int:
        """How many leading `keys` are present (a peek: recency unchanged)."""
        n = 0
        while n < len(keys) and keys[n] in self._slots:
            n += 1
        return n

    def pin(self, slots: list[int]) -> None:
        """Keep these slots from being saved over until `unpin_all` (the plan loading them is built)."""
        self._pinned.update(slots)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def assign(self, key: bytes) -> int | None:
        """A slot for a new block under `key`: a free one, else the least recent unpinned one.

        None when the key is already held or every slot is pinned.
        """
        if key in self._slots or self.num_slots == 0:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._slots.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            self.num_evicted += 1
        self._slots[key] = slot
        self.num_saved += 1
        return slot

    def forget(self, keys: list[bytes]) -> None:
        """Drop keys whose save never ran (its plan was lost): their slots hold something else."""
        for key in keys:
            slot = self._slots.pop(key, None)
            if slot is not None:
                self._free.append(slot)

    def clear(self) -> None:
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()
