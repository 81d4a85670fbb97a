"""KV store test entries: random float payloads with their headers and blobs."""

from __future__ import annotations

import hashlib

import numpy as np

from services.kv_entry import EntryHeader, encode_entry, make_header

FP = hashlib.sha256(b"test-model/float32/bs16").digest()
OTHER_FP = hashlib.sha256(b"another-model").digest()
LAYOUT = "blocks,kv,layers,block_size,heads,head_dim"


def key(i: int, fingerprint: bytes = FP) -> bytes:
    return hashlib.sha256(fingerprint + i.to_bytes(8, "little")).digest()


def payload(nbytes: int, seed: int = 0) -> bytes:
    """`nbytes` (a multiple of 4) of float32 noise."""
    return np.random.default_rng(seed).standard_normal(nbytes // 4, dtype=np.float32).tobytes()


def entry(i: int, nbytes: int = 4096, fingerprint: bytes = FP) -> tuple[bytes, EntryHeader, bytes]:
    """(key, header, payload) of entry i: float32 of shape (1, 2, nbytes / 8), 16 tokens."""
    data = payload(nbytes, seed=i)
    header = make_header(fingerprint, "float32", (1, 2, nbytes // 8), LAYOUT, 16, data)
    return key(i, fingerprint), header, data


def blob(i: int, nbytes: int = 4096, fingerprint: bytes = FP) -> tuple[bytes, bytes]:
    """(key, blob) of entry i, in the stored format."""
    k, header, data = entry(i, nbytes, fingerprint)
    return k, encode_entry(header, data)
