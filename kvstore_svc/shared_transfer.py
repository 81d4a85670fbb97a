"""The store's half of GetShared / PutShared: entries copied into and out of a client's segment.

No transport: the servicer opens the segment (`shm.SegmentMaps`) and converts protobuf;
these functions move the bytes between a region of it and the store, one copy each way
(tier -> segment for a get; segment -> the arena slot, or a private blob without an arena,
then checked, for a put: the checksum is taken on the store's own copy, so a client that
rewrites its segment during the call can spoil only its own entry's check, never a stored
entry).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore_svc.shm import Region, align
from kvstore_svc.store import TieredKVStore, check_key, check_keys
from services.kv_entry import CorruptEntry, EntryHeader


@dataclass(frozen=True)
class SharedEntry:
    """An entry whose payload lies at `offset` of the segment (kvstore.proto SharedEntry)."""

    key: bytes
    header: EntryHeader
    offset: int


def copy_out(
    store: TieredKVStore,
    fingerprint: bytes,
    keys: Sequence[bytes],
    segment: memoryview,
    region: Region,
) -> tuple[list[SharedEntry], bool]:
    """Copy the leading present entries into `region` of `segment`, packed and aligned.

    Returns them and whether the run stopped because the next one did not fit (not a miss).
    """
    check_keys(fingerprint, keys)
    out: list[SharedEntry] = []
    pos = align(region.offset)
    for key in keys:
        found = store.get(fingerprint, key)
        if found is None:
            return out, False
        header, payload = found
        n = header.payload_length
        if not region.holds(pos, n):
            return out, True
        segment[pos : pos + n] = payload
        out.append(SharedEntry(key, header, pos))
        pos = align(pos + n)
    return out, False


def ingest(
    store: TieredKVStore,
    fingerprint: bytes,
    entries: Sequence[SharedEntry],
    segment: memoryview,
    region: Region,
) -> tuple[int, int]:
    """Store the entries whose payloads lie in `region`: (stored, rejected by every tier).

    Raises CorruptEntry naming the first entry that fails (its payload outside the region,
    a bad key or header, a checksum mismatch); the entries before it are stored.
    """
    check_keys(fingerprint, [])
    stored = rejected = 0
    for i, e in enumerate(entries):
        try:
            check_key(e.key)
            if e.header.fingerprint != fingerprint:
                raise CorruptEntry("header fingerprint differs from the request's")
            n = e.header.payload_length
            if not region.holds(e.offset, n):
                raise CorruptEntry(
                    f"payload [{e.offset}, {e.offset + n}) lies outside the region "
                    f"[{region.offset}, {region.end})"
                )
            # The one copy: into the arena slot (or a private blob), checksummed there.
            ok = store.put_payload(fingerprint, e.key, e.header, segment[e.offset : e.offset + n])
        except (CorruptEntry, ValueError) as err:
            raise CorruptEntry(
                f"entry {i} (key {e.key.hex()[:16]}): {err} ({stored + rejected} earlier entries "
                "stored, this one not)"
            ) from None
        stored += ok
        rejected += not ok
    return stored, rejected
