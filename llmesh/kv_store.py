"""The KV store an offline engine uses: `LLM(kv_store=...)`.

`kv_store` may be "host:port" (a running `llmesh kvstore` service, shared with
any other engine or mesh; on its host, reached through shared memory: see
`kv_store_shared_memory`), "memory" or "memory:<bytes>" (the store's core in
this process: the tiers without the service), or an object with the client's
`lookup`/`get`/`put` (a `KVStoreClient`, an `InProcessKVStore`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvstore_svc.store import TieredKVStore
from kvstore_svc.tiers.memory import MemoryTier
from services.kv_entry import encode_entry

DEFAULT_MEMORY_BYTES = 1 << 30


class InProcessKVStore:
    """A `TieredKVStore` behind the same calls as the gRPC client."""

    def __init__(self, store: TieredKVStore) -> None:
        self.store = store

    def lookup(self, fingerprint: bytes, keys: list[bytes]) -> int:
        return self.store.lookup(fingerprint, keys)

    def put(self, fingerprint: bytes, entries: list) -> int:
        # The worker made each header from its payload moments ago: hashing it twice more buys nothing.
        return sum(
            self.store.put(fingerprint, key, encode_entry(header, data, verify=False), verify_checksum=False)
            for key, header, data in entries
        )

    def get(self, fingerprint: bytes, keys: list[bytes]) -> list:
        out = []
        for key in keys:
            hit = self.store.get(fingerprint, key)
            if hit is None:
                break
            header, payload = hit
            out.append((key, header, payload))
        return out

    def get_each(self, fingerprint: bytes, keys: list[bytes], consume, *, fence=None) -> int:
        """`KVStoreClient.get_each`: each payload a view of the store's memory (no copy), waited
        for (`fence`) before the next: the store may evict it once it is handed over."""
        n = 0
        for key in keys:
            hit = self.store.get(fingerprint, key)
            if hit is None:
                break
            n += 1
            go_on = consume(key, *hit)
            if fence is not None:
                fence()()
            if go_on is False:
                break
        return n

    def close(self) -> None:
        self.store.close()


class ThreadedLookup:
    """The Mesh's async lookup over a blocking client (run in a thread: the loop never waits on it)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def lookup(self, fingerprint: bytes, keys: list[bytes]) -> int:
        return await asyncio.to_thread(self.client.lookup, fingerprint, keys)


def open_kv_store(
    spec: Any, *, shared_memory: str = "auto", segment_bytes: int = 128 << 20, transfer: str = "auto"
) -> Any:
    """A store client from `LLM(kv_store=...)`'s value (see the module docstring).

    For a service, `shared_memory` / `segment_bytes` / `transfer` are the client's
    (`KVStoreClient`): on its own host the payloads go through shared memory segments, from
    another host (or with transfer="bulk") over the store's bulk path.
    """
    if not isinstance(spec, str):
        return spec
    if spec == "memory" or spec.startswith("memory:"):
        size = int(spec.partition(":")[2] or DEFAULT_MEMORY_BYTES)
        return InProcessKVStore(TieredKVStore(memory=MemoryTier(size)))
    from kvstore_svc.client import KVStoreClient  # gRPC only when a service is named

    return KVStoreClient(spec, shared_memory=shared_memory, segment_bytes=segment_bytes, transfer=transfer)
