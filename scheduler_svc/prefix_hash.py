"""Content hashes of full KV blocks: the one key shared by worker, scheduler and KV store.

key(block i) = sha256(key(block i-1) || fingerprint || token ids of block i as int32 LE)

The fingerprint names the model and the cache layout, so blocks of different
models or block sizes never collide. sha256 is stable across processes and
languages (never Python's hash()).
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_KEY = b"\x00" * 32


def block_key(parent: bytes, token_ids: list[int], fingerprint: bytes) -> bytes:
    h = hashlib.sha256(parent)
    h.update(fingerprint)
    h.update(array("i", token_ids).tobytes())
    return h.digest()


def extend_block_keys(
    keys: list[bytes], token_ids: list[int], block_size: int, fingerprint: bytes
) -> list[bytes]:
    """Append keys for every full block of `token_ids` not yet in `keys` (in place; returns keys)."""
    num_full = len(token_ids) // block_size
    parent = keys[-1] if keys else ROOT_KEY
    for i in range(len(keys), num_full):
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size], fingerprint)
        keys.append(parent)
    return keys
