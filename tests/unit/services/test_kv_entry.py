"""The entry format: encode/decode round trips, and every corruption caught as CorruptEntry."""

from __future__ import annotations

import pathlib
import re
import struct

import numpy as np
import pytest
import xxhash

from services import kv_entry as E
from services.kv_entry import CorruptEntry, EntryHeader, decode_entry, encode_entry, make_header
from tests.helpers.kv_entries import FP, LAYOUT


def sample(dtype: str = "float32", shape=(2, 3, 4)) -> tuple[EntryHeader, bytes]:
    nbytes = int(np.prod(shape)) * E.DTYPE_SIZES[dtype]
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    return make_header(FP, dtype, shape, LAYOUT, 16, data), data


def test_round_trip_keeps_header_and_payload():
    header, data = sample()
    blob = encode_entry(header, data)
    assert blob[:4] == b"LMKV"
    got, payload = decode_entry(blob)
    assert got == header and bytes(payload) == data
    assert header.payload_length == len(data) and header.checksum == xxhash.xxh64_intdigest(data)
    assert header.format_version == E.FORMAT_VERSION


def test_pieces_encode_like_the_joined_payload():
    header, data = sample()
    assert encode_entry(header, [data[:5], memoryview(data)[5:50], data[50:]]) == encode_entry(header, data)


@pytest.mark.parametrize(
    "dtype,storage", [("float32", np.float32), ("bfloat16", np.uint16), ("float8_e5m2", np.uint8)]
)
def test_payload_array_views_the_payload_in_its_shape(dtype, storage):
    header, data = sample(dtype)
    _, payload = decode_entry(encode_entry(header, data))
    arr = E.payload_array(header, payload)
    assert arr.shape == (2, 3, 4) and arr.dtype == storage and arr.tobytes() == data


def test_header_survives_the_proto_both_ways():
    header, _ = sample()
    assert E.header_from_proto(E.header_to_proto(header)) == header


def _flip(blob: bytes, offset: int) -> bytes:
    b = bytearray(blob)
    b[offset] ^= 0x40
    return bytes(b)


def _corruptions() -> dict[str, bytes]:
    header, data = sample()
    blob = encode_entry(header, data)
    head_len = struct.unpack_from("<I", blob, 4)[0]
    bad_version = EntryHeader(**{**vars(header), "format_version": 2})
    head = E.header_to_proto(bad_version).SerializeToString()
    v2 = struct.pack("<4sIQ", b"LMKV", len(head), xxhash.xxh64_intdigest(head)) + head + data
    junk = b"\x08\x01\xff\xff"
    undecodable = struct.pack("<4sIQ", b"LMKV", len(junk), xxhash.xxh64_intdigest(junk)) + junk
    return {
        "empty": b"",
        "short prefix": blob[:10],
        "bad magic": b"XXXX" + blob[4:],
        "header length too big": blob[:4] + struct.pack("<I", 1 << 30) + blob[8:],
        "header checksum": _flip(blob, 16 + 2),
        "payload bit flip": _flip(blob, len(blob) - 1),
        "truncated payload": blob[:-1],
        "extra payload byte": blob + b"\x00",
        "payload length beyond blob": blob[: 16 + head_len],
        "future version": v2,
        "header does not parse": undecodable,
    }


@pytest.mark.parametrize("name", list(_corruptions()))
def test_every_corruption_is_caught(name):
    with pytest.raises(CorruptEntry):
        decode_entry(_corruptions()[name])


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"dtype": "complex64"}, "unknown dtype"),
        ({"shape": (2, 3, 5)}, "payload_length"),
        ({"shape": (2, 0, 4)}, "shape"),
        ({"shape": ()}, "shape"),
        ({"fingerprint": b""}, "fingerprint"),
        ({"fingerprint": b"x" * 65}, "fingerprint"),
        ({"layout": "x" * 300}, "layout"),
        ({"num_tokens": -1}, "num_tokens"),
    ],
)
def test_inconsistent_headers_are_refused(change, needle):
    header, data = sample()
    bad = EntryHeader(**{**vars(header), **change})
    with pytest.raises(CorruptEntry, match=needle):
        encode_entry(bad, data)
    if "num_tokens" not in change:  # a uint64 field: the proto cannot even hold it
        with pytest.raises(CorruptEntry, match=needle):
            E.header_from_proto(E.header_to_proto(bad))


def test_encode_refuses_a_payload_the_header_does_not_describe():
    header, data = sample()
    with pytest.raises(CorruptEntry, match="checksum"):
        encode_entry(header, data[::-1])
    with pytest.raises(CorruptEntry, match="bytes"):
        encode_entry(header, data[:-4])


def test_size_limit_is_checked_from_the_header_alone():
    header, _ = sample()
    with pytest.raises(CorruptEntry, match="exceeds"):
        E.header_from_proto(E.header_to_proto(header), max_payload_bytes=header.payload_length - 1)


def test_without_checksum_verification_sizes_are_still_checked():
    header, data = sample()
    blob = encode_entry(header, data)
    decode_entry(_flip(blob, len(blob) - 1), verify_checksum=False)  # payload bits: not looked at
    with pytest.raises(CorruptEntry):
        decode_entry(blob[:-1], verify_checksum=False)


def test_no_pickle_in_the_kv_store():
    unsafe = re.compile(r"^\s*(import|from)\s+(c?pickle|dill|marshal|shelve)\b|pickle\.loads?\(", re.M)
    for path in pathlib.Path(E.__file__).parent.rglob("*.py"):
        assert not unsafe.search(path.read_text()), path
