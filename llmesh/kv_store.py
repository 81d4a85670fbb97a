"""The KV store an offline engine uses: `LLM(kv_store=...)`.

`kv_store` may be "host:port" (a running `llmesh kvstore` service, shared with
any other engine or mesh), "memory" or "memory:<bytes>" (the store's core in
this process: the tiers without the service), or an object with the client's
`lookup`/`get`/`put` (a `KVStoreClient`, an `InProcessKVStore`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvstore_svc.entry import encode_entry
from kvstore_svc.store import TieredKVStore
from kvstore_svc.tiers.memory import MemoryTier

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

    def close(self) -> None:
        self.store.close()


class ThreadedLookup:
    """The Mesh's async lookup over a blocking client (run in a thread: the loop never waits on it)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def lookup(self, fingerprint: bytes, keys: list[bytes]) -> int:
        return await asyncio.to_thread(self.client.lookup, fingerprint, keys)


def open_kv_store(spec: Any) -> Any:
    """A store client from `LLM(kv_store=...)`'s value (see the module docstring)."""
    if not isinstance(spec, str):
        return spec
    if spec == "memory" or spec.startswith("memory:"):
        size = int(spec.partition(":")[2] or DEFAULT_MEMORY_BYTES)
        return InProcessKVStore(TieredKVStore(memory=MemoryTier(size)))
    from kvstore_svc.client import KVStoreClient  # gRPC only when a service is named

    return KVStoreClient(spec)
