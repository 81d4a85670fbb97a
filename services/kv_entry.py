"""The KV store's value format: raw tensor bytes behind an explicit, checked header.

Shared by the store and its clients (the worker exports/imports KV blocks with
it), so it is plain Python + numpy + the generated protobuf module, no torch.

An entry on disk, in Redis and in memory is one blob:

    offset  size  field
    0       4     magic b"LMKV"
    4       4     header length H, uint32 little-endian
    8       8     xxhash64 of the header bytes, uint64 little-endian
    16      H     the header: llmesh.v1.EntryHeader (protos/llmesh/v1/kvstore.proto), serialized
    16+H    P     the payload, P = header.payload_length bytes; xxhash64(payload) = header.checksum

The header is the proto message, so that a client in any language reads the
same fields that travel in Put/Get; `EntryHeader` below is its Python view and
the one place both directions are checked. Nothing is ever unpickled: a blob
that fails any check raises `CorruptEntry`, and the store treats that as a miss.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash
from google.protobuf.message import DecodeError

from llmesh.v1 import kvstore_pb2

MAGIC = b"LMKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sIQ")  # magic, header length, header checksum
PREFIX_BYTES = _PREFIX.size
# Bounds that keep a hostile or corrupt header from making us allocate or loop much.
MAX_HEADER_BYTES = 4096
MAX_FINGERPRINT_BYTES = 64
MAX_LAYOUT_BYTES = 256
MAX_DIMS = 16
MAC_BYTES = 32  # HMAC-SHA256

# Element size of each dtype a payload may hold. bfloat16 and the float8s have
# no numpy dtype: `payload_array` gives them as raw integers of the same width.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
_NUMPY_STORAGE = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float64": np.float64,
    "int8": np.int8,
    "uint8": np.uint8,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
}

Payload = bytes | bytearray | memoryview


class CorruptEntry(ValueError):
    """A header or payload that fails a check: wrong magic, sizes, checksum, field values."""


def checksum(payload: Payload) -> int:
    """xxhash64 (seed 0) of the payload: the header's `checksum`."""
    return xxhash.xxh64_intdigest(payload)


@dataclass(frozen=True)
class EntryHeader:
    """What a payload holds (the Python view of llmesh.v1.EntryHeader); `validate()` checks it."""

    fingerprint: bytes
    dtype: str
    shape: tuple[int, ...]
    layout: str
    num_tokens: int
    payload_length: int
    checksum: int
    format_version: int = FORMAT_VERSION
    mac: bytes = b""  # the writer's keyed MAC (services/kv_mac.py); the store keeps it, never checks it

    def validate(self, max_payload_bytes: int | None = None) -> None:
        """Raise CorruptEntry unless every field is in range and dtype x shape = payload_length."""
        if self.format_version != FORMAT_VERSION:
            raise CorruptEntry(f"format version {self.format_version} (this build reads {FORMAT_VERSION})")
        if not 1 <= len(self.fingerprint) <= MAX_FINGERPRINT_BYTES:
            raise CorruptEntry(f"fingerprint must be 1..{MAX_FINGERPRINT_BYTES} bytes")
        if self.dtype not in DTYPE_SIZES:
            raise CorruptEntry(f"unknown dtype {self.dtype[:32]!r} (one of {', '.join(DTYPE_SIZES)})")
        if not 1 <= len(self.shape) <= MAX_DIMS or any(d < 1 for d in self.shape):
            raise CorruptEntry(f"shape must have 1..{MAX_DIMS} dimensions, each >= 1; got {self.shape[:32]}")
        if len(self.layout.encode()) > MAX_LAYOUT_BYTES:
            raise CorruptEntry(f"layout longer than {MAX_LAYOUT_BYTES} bytes")
        if self.num_tokens < 0:
            raise CorruptEntry(f"num_tokens must be >= 0, got {self.num_tokens}")
        expected = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if self.payload_length != expected:
            raise CorruptEntry(
                f"payload_length {self.payload_length} != {self.dtype} x shape {list(self.shape)}"
                f" = {expected}"
            )
        if max_payload_bytes is not None and self.payload_length > max_payload_bytes:
            raise CorruptEntry(
                f"payload of {self.payload_length} bytes exceeds the limit of {max_payload_bytes}"
            )
        if not 0 <= self.checksum < 1 << 64:
            raise CorruptEntry("checksum out of range")
        if len(self.mac) not in (0, MAC_BYTES):
            raise CorruptEntry(f"mac must be empty or {MAC_BYTES} bytes")

    def signed_bytes(self) -> bytes:
        """What the MAC covers of the header: the header with `mac` empty, serialized deterministically."""
        return _header_bytes(dataclasses.replace(self, mac=b""))


def make_header(
    fingerprint: bytes,
    dtype: str,
    shape: Sequence[int],
    layout: str,
    num_tokens: int,
    payload: Payload,
) -> EntryHeader:
    """A header for `payload`, its length and checksum computed; raises CorruptEntry if inconsistent."""
    header = EntryHeader(
        fingerprint=bytes(fingerprint),
        dtype=dtype,
        shape=tuple(int(d) for d in shape),
        layout=layout,
        num_tokens=int(num_tokens),
        payload_length=_nbytes(payload),
        checksum=checksum(payload),
    )
    header.validate()
    return header


def check_payload(header: EntryHeader, payload: Payload) -> None:
    """Raise CorruptEntry unless `payload` is what `header` describes (length, then checksum)."""
    size = _nbytes(payload)
    if size != header.payload_length:
        raise CorruptEntry(f"payload is {size} bytes, header says {header.payload_length}")
    if checksum(payload) != header.checksum:
        raise CorruptEntry("payload checksum mismatch")


# -- proto <-> header --------------------------------------------------------------


def header_to_proto(header: EntryHeader) -> kvstore_pb2.EntryHeader:
    return kvstore_pb2.EntryHeader(
        format_version=header.format_version,
        fingerprint=header.fingerprint,
        dtype=header.dtype,
        shape=list(header.shape),
        layout=header.layout,
        num_tokens=header.num_tokens,
        payload_length=header.payload_length,
        checksum=header.checksum,
        mac=header.mac,
    )


def header_from_proto(msg: kvstore_pb2.EntryHeader, max_payload_bytes: int | None = None) -> EntryHeader:
    """The header a peer sent, validated (CorruptEntry names the first bad field)."""
    if len(msg.shape) > MAX_DIMS:  # checked before copying a hostile repeated field
        raise CorruptEntry(f"shape has {len(msg.shape)} dimensions, at most {MAX_DIMS}")
    header = EntryHeader(
        fingerprint=msg.fingerprint,
        dtype=msg.dtype,
        shape=tuple(msg.shape),
        layout=msg.layout,
        num_tokens=msg.num_tokens,
        payload_length=msg.payload_length,
        checksum=msg.checksum,
        format_version=msg.format_version,
        mac=msg.mac,
    )
    header.validate(max_payload_bytes)
    return header


# -- blobs -------------------------------------------------------------------------


def _header_bytes(header: EntryHeader) -> bytes:
    return header_to_proto(header).SerializeToString(deterministic=True)


def encode_entry(header: EntryHeader, payload: Payload | Sequence[Payload], *, verify: bool = True) -> bytes:
    """The blob of one entry. `payload` may be one buffer or its pieces in order (joined once).

    verify=True checks the header and that the payload matches it (length and
    checksum); pass False only for a payload just checked against this header.
    """
    pieces: Sequence[Payload] = [payload] if isinstance(payload, bytes | bytearray | memoryview) else payload
    if verify:
        header.validate()
        total = sum(_nbytes(p) for p in pieces)
        if total != header.payload_length:
            raise CorruptEntry(f"payload is {total} bytes, header says {header.payload_length}")
        h = xxhash.xxh64()
        for piece in pieces:
            h.update(piece)
        if h.intdigest() != header.checksum:
            raise CorruptEntry("payload checksum mismatch")
    head = _header_bytes(header)
    prefix = _PREFIX.pack(MAGIC, len(head), xxhash.xxh64_intdigest(head))
    return b"".join([prefix, head, *pieces])


def decode_header(blob: Payload) -> tuple[EntryHeader, int]:
    """The header of a blob and where its payload starts; the payload itself is not checked."""
    view = memoryview(blob)
    if len(view) < PREFIX_BYTES:
        raise CorruptEntry(f"entry of {len(view)} bytes is shorter than its {PREFIX_BYTES}-byte prefix")
    magic, head_len, head_sum = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptEntry(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if head_len > MAX_HEADER_BYTES or PREFIX_BYTES + head_len > len(view):
        raise CorruptEntry(f"header length {head_len} out of range")
    head = view[PREFIX_BYTES : PREFIX_BYTES + head_len]
    if xxhash.xxh64_intdigest(head) != head_sum:
        raise CorruptEntry("header checksum mismatch")
    msg = kvstore_pb2.EntryHeader()
    try:
        msg.ParseFromString(bytes(head))
    except DecodeError as e:
        raise CorruptEntry(f"header does not parse: {e}") from None
    return header_from_proto(msg), PREFIX_BYTES + head_len


def decode_entry(blob: Payload, *, verify_checksum: bool = True) -> tuple[EntryHeader, memoryview]:
    """(header, payload view into `blob`); raises CorruptEntry on any mismatch.

    verify_checksum=False skips hashing the payload (sizes are still checked):
    for blobs this process checked on the way in and kept in memory.
    """
    header, start = decode_header(blob)
    payload = memoryview(blob)[start:]
    if verify_checksum:
        check_payload(header, payload)
    elif len(payload) != header.payload_length:
        raise CorruptEntry(f"payload is {len(payload)} bytes, header says {header.payload_length}")
    return header, payload


def payload_array(header: EntryHeader, payload: Payload) -> np.ndarray:
    """The payload as a numpy array of header.shape, without a copy (read-only when `payload` is).

    bfloat16 comes back as uint16 and the float8s as uint8 (same bytes): numpy
    has no such dtypes; `torch.from_numpy(a).view(torch.bfloat16)` restores them.
    """
    return np.frombuffer(payload, dtype=_NUMPY_STORAGE[header.dtype]).reshape(header.shape)


def _nbytes(buf: Payload) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)
