"""A keyed digest of KV payloads, computed where the bytes already are (GPU or CPU), for their MAC.

The KV store, its disk and Redis are untrusted storage, so an entry's MAC must be checked before
its bytes reach a forward. A cryptographic hash of an 8k-token prefix of an 8B model (1 GiB) takes
the CPU ~0.5 s; this digest takes the GPU about a millisecond, as one int8 GEMM over the bytes
already uploaded, and leaves the host a few KiB to authenticate (services/kv_mac.py:
HMAC-SHA256 over the digest). The construction is hash-then-MAC (a keyed almost-universal hash
whose output only ever appears under HMAC, so the attacker never sees it):

    the payload's bytes, zero-padded to whole rows of ROW_BYTES, as signed int8: A  [rows, ROW_BYTES]
    a secret key matrix of non-zero int8 entries, derived from the MAC key:    K  [ROW_BYTES, LANES]
    digest = A @ K, exact in int32 (|sum| <= 65536 * 128 * 127 < 2**31):      D  [rows, LANES]

Two different payloads of the same (authenticated) length differ in some row; for one lane, fix
every key entry but one where they differ: at most one value of it makes that lane agree, and it
is drawn from 254 values with probability <= 2/256. The lanes are independent, so a payload chosen
without knowing K collides with probability <= 2**-224. K never leaves the worker.

`kv_digest` is `torch._int_mm` (an int8 GEMM: cuBLAS on CUDA); its twin `kv_digest_reference` is
the same product in float64 (exact at these magnitudes). Both give the same int32 digest, so CPU
and GPU workers agree on every entry. On an H100, cuBLAS streams A @ K (a 32-wide output) at
~490 GB/s, but its transpose K^T @ A^T (A read as a column-major operand, the layout its int8
kernels want) at ~2.8 TB/s, faster than a device-to-device copy of the same bytes: 0.39 ms a
GiB, measured against 0.43 ms for a hand-written Triton pass. So K is kept as K^T, contiguous.
"""

from __future__ import annotations

import hashlib

import torch

ROW_BYTES = 1 << 16  # bytes of payload per digest row: 64 KiB -> 64 bytes of digest
LANES = 32  # int32 digest words per row: independent lanes of the bound above (> 16: see kv_digest)
_MIN_ROWS = 24  # torch._int_mm wants more than 16 rows, in multiples of 8


def digest_key(secret: bytes, device: torch.device | str = "cpu") -> torch.Tensor:
    """K, [ROW_BYTES, LANES] int8 with no zero entry, expanded from `secret` by SHAKE-256
    (stored column-major: `K.t()` is contiguous, the operand the GPU's GEMM takes)."""
    raw = hashlib.shake_256(b"llmesh kv digest key v2\x00" + secret).digest(ROW_BYTES * LANES)
    v = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int16) % 254
    k = torch.where(v < 127, v - 127, v - 126)  # 0..253 -> -127..-1, 1..127
    return k.to(torch.int8).view(LANES, ROW_BYTES).to(device).t()


def digest_rows(num_bytes: int) -> int:
    """Rows of digest (of LANES int32 words each) of a payload of `num_bytes`."""
    return -(-num_bytes // ROW_BYTES)


def _rows(payload: torch.Tensor) -> torch.Tensor:
    """The payload's bytes as int8 rows of ROW_BYTES (zero-padded, at least _MIN_ROWS rows)."""
    flat = payload.reshape(-1).view(torch.int8)
    n = flat.numel()
    rows = digest_rows(n)
    if n == rows * ROW_BYTES and rows >= _MIN_ROWS and rows % 8 == 0:
        return flat.view(rows, ROW_BYTES)  # no copy: the common case on the GPU (2 MiB blocks)
    padded = torch.zeros(max(-(-rows // 8) * 8, _MIN_ROWS) * ROW_BYTES, dtype=torch.int8, device=flat.device)
    padded[:n] = flat
    return padded.view(-1, ROW_BYTES)


def kv_digest(payload: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """D = rows(payload) @ key, [digest_rows(payload bytes), LANES] int32, on payload's device.

    `payload`: any contiguous tensor (its bytes are digested); `key`: `digest_key` on the same device.
    """
    rows = digest_rows(payload.numel() * payload.element_size())
    a = _rows(payload)
    if a.is_cuda:  # (K^T @ A^T)^T: the layout cuBLAS streams at full speed (module docstring)
        return torch._int_mm(key.t(), a.t()).t()[:rows]
    return torch._int_mm(a, key)[:rows]


def kv_digest_batch(chunks: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The digests of equal-sized chunks, [n, rows, LANES]: one GEMM when each chunk is whole rows."""
    n = chunks.shape[0]
    chunk_bytes = chunks[0].numel() * chunks.element_size()
    if chunk_bytes % ROW_BYTES or n * chunk_bytes // ROW_BYTES < _MIN_ROWS:
        return torch.stack([kv_digest(c, key) for c in chunks])
    return kv_digest(chunks, key).reshape(n, chunk_bytes // ROW_BYTES, LANES)


def kv_digest_reference(payload: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The twin of `kv_digest`: the same product in float64 on the CPU (exact below 2**53)."""
    rows = digest_rows(payload.numel() * payload.element_size())
    a = _rows(payload.cpu()).to(torch.float64)
    return (a @ key.cpu().to(torch.float64)).to(torch.int32)[:rows]
