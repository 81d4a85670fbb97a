"""Content hashes of full KV blocks: the one key shared by worker, scheduler, router and KV store.

key(block i) = sha256(key(block i-1) || fingerprint || token ids of block i as int32 LE)
key(block -1) = the chain's root: ROOT_KEY, or root_key(salt) for a salted request

The fingerprint names the model and the cache layout, so blocks of different
models or block sizes never collide. sha256 is stable across processes and
languages (never Python's hash()).

Tenant isolation (vLLM's `cache_salt`): a salt changes the root, hence the first
block's key and every key after it. Requests with different salts share no cached
block in any tier (GPU, host, KV store), and one tenant cannot test whether another
sent a prompt by looking its keys up. The empty salt keeps ROOT_KEY, so unsalted
keys (and entries already in a KV store) stay what they were.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_KEY = b"\x00" * 32
# Domain tag of salted roots: no salt's root can equal ROOT_KEY or a block key.
_SALT_TAG = b"llmesh-cache-salt-v1\0"
MAX_SALT_BYTES = 256  # GenerateRequest.cache_salt's limit (UTF-8 bytes)


def root_key(salt: str = "") -> bytes:
    """The parent key of a chain's first block: ROOT_KEY unsalted, else sha256(tag || salt)."""
    if not salt:
        return ROOT_KEY
    return hashlib.sha256(_SALT_TAG + salt.encode("utf-8")).digest()


def check_salt(salt: str) -> None:
    """Raise ValueError unless `salt` fits a GenerateRequest (at most MAX_SALT_BYTES of UTF-8)."""
    size = len(salt.encode("utf-8"))
    if size > MAX_SALT_BYTES:
        raise ValueError(f"at most {MAX_SALT_BYTES} bytes of UTF-8, got {size}")


def block_key(parent: bytes, token_ids: list[int], fingerprint: bytes) -> bytes:
    h = hashlib.sha256(parent)
    h.update(fingerprint)
    h.update(array("i", token_ids).tobytes())
    return h.digest()


def extend_block_keys(
    keys: list[bytes], token_ids: list[int], block_size: int, fingerprint: bytes, root: bytes = ROOT_KEY
) -> list[bytes]:
    """Append keys for every full block of `token_ids` not yet in `keys` (in place; returns keys).

    `root`: the chain's root (`root_key(salt)`); it only matters while `keys` is empty.
    """
    num_full = len(token_ids) // block_size
    parent = keys[-1] if keys else root
    for i in range(len(keys), num_full):
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size], fingerprint)
        keys.append(parent)
    return keys


def short_key(key: bytes) -> int:
    """A block key's first 8 bytes as an unsigned int: what KV events and the router's index carry.

    64 bits keep a million-block index free of collisions in practice (the chance of any is about
    n^2 / 2^65), and a collision there costs only a routing hint, never a wrong KV block: the
    worker's own cache and the KV store match the whole 32-byte key.
    """
    return int.from_bytes(key[:8], "big")
