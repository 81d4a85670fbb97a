"""Paged KV block accounting for one worker: ref counts, free list, automatic prefix caching.

Blocks of finished requests keep their content key and stay reusable until the
free list hands them out again (least recently freed first). The scheduler owns
this object; the worker only ever sees block ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from scheduler_svc.prefix_hash import ROOT_KEY, extend_block_keys


class KeyListener(Protocol):
    def stored(self, key: bytes) -> None: ...
    def removed(self, key: bytes) -> None: ...


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None  # content key once the block is full and scheduled for compute


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found cached
    requests_hit: int = 0


@dataclass
class BlockTable:
    """One sequence's blocks and the content keys of its full blocks."""

    block_ids: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    root: bytes = ROOT_KEY  # the key chain's root: the request's cache salt (prefix_hash.root_key)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, fingerprint: bytes = b"", enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = evicted first). Cached blocks wait here too.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # content key -> block id
        self.tables: dict[str, BlockTable] = {}
        # Finished sequences whose blocks stay referenced until released (a prefill worker's blocks
        # while a decode worker copies them: scheduler_svc/disaggregation.py).
        self.held: dict[str, BlockTable] = {}
        self.stats = PrefixCacheStats()
        # (block id, key) registered since the last take_newly_keyed(): the planner ties them to
        # the plan that computes them, to forget them if that plan is lost with its worker link.
        self._newly_keyed: list[tuple[int, bytes]] = []
        # Blocks per KV store chunk (0: no store). A registered block that ends a chunk is listed
        # with the chunk's block ids in _newly_chunked, for the plan that copies it to the store.
        self.chunk_blocks = 0
        self._newly_chunked: list[tuple[bytes, list[int]]] = []
        # Told of every key this cache starts and stops holding (kv_events.WorkerKeys): the
        # scheduler's KV events for the routers in front of it. None: nobody listens.
        self.listener: KeyListener | None = None

    # ----- queries -----
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def block_ids(self, seq_id: str) -> list[int]:
        table = self.tables.get(seq_id)
        return table.block_ids if table else []

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def longest_cached_prefix(
        self, token_ids: list[int], keys: list[bytes] | None = None, root: bytes = ROOT_KEY
    ) -> list[int]:
        """Block ids of the longest run of leading full blocks already cached (no refs taken).

        `keys`: the blocks' content keys if the caller has them already (made from `root`);
        `root`: the chain's root, so a salted request only ever finds its own salt's blocks.
        """
        if not self.enable_prefix_caching:
            return []
        if keys is None:
            keys = extend_block_keys([], token_ids, self.block_size, self.fingerprint, root)
        hits: list[int] = []
        for key in keys:
            block_id = self.cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # ----- allocation -----
    def allocate(
        self,
        seq_id: str,
        token_ids: list[int] | Callable[[], list[int]],
        num_computed: int,
        num_new: int,
        num_known: int | None = None,
        root: bytes = ROOT_KEY,
    ) -> list[int] | None:
        """Make room for `num_new` tokens after `num_computed` of `token_ids`.

        On a sequence's first call this takes references on its cached prefix
        (`num_computed` must then equal the cached length the planner got from
        `longest_cached_prefix`). Returns the newly appended block ids, or None
        (nothing changed) when the free list is too short.

        `token_ids` may be a function that makes the list, with `num_known` its
        length: a decode step then builds it only when a block fills (once in
        `block_size` steps), not every step. `root`: the root of the sequence's key chain
        (its cache salt), kept in its table from the first call on.
        """
        end, size = num_computed + num_new, self.block_size
        table = self.tables.get(seq_id)
        hits: list[int] = []
        if table is None:
            token_ids = token_ids() if callable(token_ids) else token_ids
            hits = self.longest_cached_prefix(token_ids, root=root)[: num_computed // size]
            assert len(hits) * size == num_computed, "first allocation starts at the cached prefix"
        need = self.blocks_needed(end) - (len(table.block_ids) if table else len(hits))
        # A decode needs a block once in block_size steps: the other steps of a large batch's
        # sequences (every step, every sequence) skip the free-list work.
        if need > 0:
            # Cached hits sitting in the free list are taken out of it, so they cannot also be fresh blocks.
            reusable = sum(1 for b in hits if self.blocks[b].ref_count == 0)
            if need > len(self.free) - reusable:
                return None
        if table is None:
            table = self.tables[seq_id] = BlockTable(root=root)
            for block_id in hits:
                self._take(block_id)
                table.block_ids.append(block_id)
            table.num_cached_blocks = len(hits)
        new_ids: list[int] = []
        if need > 0:
            new_ids = [self._take_fresh() for _ in range(need)]
            table.block_ids.extend(new_ids)
        if self.enable_prefix_caching:
            known = num_known if callable(token_ids) else len(token_ids)
            assert known is not None, "num_known is needed with a token_ids function"
            if min(end, known) // size > table.num_cached_blocks:
                self._register_full_blocks(table, token_ids() if callable(token_ids) else token_ids, end)
        return new_ids

    def free_seq(self, seq_id: str) -> None:
        """Drop a sequence's references; its blocks join the free list, tail first."""
        table = self.tables.pop(seq_id, None)
        if table is not None:
            self._unref(table)

    def _unref(self, table: BlockTable) -> None:
        for block_id in reversed(table.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free[block_id] = None

    def hold(self, seq_id: str) -> list[int]:
        """Keep a finishing sequence's blocks referenced (under its id, apart from the running
        ones) until `release_hold`: its free_seq then frees nothing. Returns the block ids."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return []
        self.release_hold(seq_id)  # an older hold of the same id (never twice, but never leaked)
        self.held[seq_id] = table
        return table.block_ids

    def release_hold(self, seq_id: str) -> bool:
        """Free a held sequence's blocks (idempotent); True if it held any."""
        table = self.held.pop(seq_id, None)
        if table is None:
            return False
        self._unref(table)
        return True

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit
        self.stats.requests_hit += num_hit > 0

    def take_newly_keyed(self) -> list[tuple[int, bytes]]:
        keyed, self._newly_keyed = self._newly_keyed, []
        return keyed

    def take_newly_chunked(self) -> list[tuple[bytes, list[int]]]:
        """(key of a chunk's last block, the chunk's block ids) for chunks completed since last asked."""
        chunked, self._newly_chunked = self._newly_chunked, []
        return chunked

    def forget_keys(self, keyed: list[tuple[int, bytes]]) -> None:
        """Unregister blocks whose content was never written (their plan was lost)."""
        for block_id, key in keyed:
            block = self.blocks[block_id]
            if block.key == key:
                block.key = None
                if self.cached.get(key) == block_id:
                    del self.cached[key]
                    if self.listener is not None:
                        self.listener.removed(key)

    def reset_prefix_cache(self) -> None:
        """Forget every cached key (e.g. after a worker restarts with an empty cache)."""
        for block in self.blocks:
            if block.ref_count == 0:
                block.key = None
        kept = {k: b for k, b in self.cached.items() if self.blocks[b].key == k}
        if self.listener is not None:
            for key in self.cached.keys() - kept.keys():
                self.listener.removed(key)
        self.cached = kept

    # ----- internals -----
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:  # evict its cached content
            if self.cached.get(block.key) == block_id:
                del self.cached[block.key]
                if self.listener is not None:
                    self.listener.removed(block.key)
            block.key = None
        block.ref_count = 1
        return block_id

    def _register_full_blocks(self, table: BlockTable, token_ids: list[int], num_tokens: int) -> None:
        """Give keys to blocks that will be full once `num_tokens` are computed.

        Registering at schedule time is safe: the worker writes a layer's K/V for
        the whole batch before that layer attends, so a second sequence of the
        same step that hits these blocks reads them already filled.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, len(token_ids)) // self.block_size
        if num_full <= table.num_cached_blocks:
            return
        extend_block_keys(
            table.keys, token_ids[: num_full * self.block_size], self.block_size, self.fingerprint, table.root
        )
        chunk = self.chunk_blocks
        for i in range(table.num_cached_blocks, num_full):
            block = self.blocks[table.block_ids[i]]
            key = table.keys[i]
            if block.key is None and key not in self.cached:
                block.key = key
                self.cached[key] = block.block_id
                self._newly_keyed.append((block.block_id, key))
                if self.listener is not None:
                    self.listener.stored(key)
                if chunk and (i + 1) % chunk == 0:
                    self._newly_chunked.append((key, table.block_ids[i + 1 - chunk : i + 1]))
        table.num_cached_blocks = num_full

    def check_invariants(self) -> None:
        """Ref counts equal table references; free list = unreferenced blocks (tests call this)."""
        refs = [0] * self.num_blocks
        for table in [*self.tables.values(), *self.held.values()]:
            for block_id in table.block_ids:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} ref mismatch"
            assert (block.ref_count == 0) == (block.block_id in self.free), (
                f"block {block.block_id} free mismatch"
            )
        for key, block_id in self.cached.items():
            assert self.blocks[block_id].key == key
