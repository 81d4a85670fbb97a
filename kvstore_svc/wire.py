"""Entries on the wire: one header message, then payload pieces (Put requests and Get responses alike).

Both sides of both calls use these helpers, so the framing rules of
kvstore.proto are written once: `put_requests` / `get_responses` cut entries
into messages, `EntryAssembler` puts them back together and refuses anything
that breaks the rules before buffering more than the header promised.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvstore_svc.config import PIECE_BYTES
from llmesh.v1 import kvstore_pb2
from services.kv_entry import CorruptEntry, EntryHeader, Payload, header_from_proto, header_to_proto

EntryIn = tuple[bytes, EntryHeader, Payload]


def iter_pieces(payload: Payload, piece_bytes: int = PIECE_BYTES) -> Iterator[bytes]:
    """The payload cut into pieces of at most `piece_bytes` (one copy each: protobuf wants bytes)."""
    view = memoryview(payload).cast("B")
    for start in range(0, max(len(view), 1), piece_bytes):
        yield bytes(view[start : start + piece_bytes])


def put_requests(
    fingerprint: bytes, entries: Iterable[EntryIn], piece_bytes: int = PIECE_BYTES
) -> Iterator[kvstore_pb2.PutRequest]:
    """A Put stream: the fingerprint in the first message, then each entry as header + pieces."""
    first = True
    for key, header, payload in entries:
        for i, piece in enumerate(iter_pieces(payload, piece_bytes)):
            if i == 0:
                yield kvstore_pb2.PutRequest(
                    fingerprint=fingerprint if first else b"",
                    key=key,
                    header=header_to_proto(header),
                    data=piece,
                )
                first = False
            else:
                yield kvstore_pb2.PutRequest(data=piece)
    if first:  # no entries: still a well-formed stream
        yield kvstore_pb2.PutRequest(fingerprint=fingerprint)


def get_responses(
    key: bytes, header: EntryHeader, payload: Payload, piece_bytes: int = PIECE_BYTES
) -> Iterator[kvstore_pb2.GetResponse]:
    """One entry of a Get stream: its header with the first piece, then the other pieces."""
    for i, piece in enumerate(iter_pieces(payload, piece_bytes)):
        if i == 0:
            yield kvstore_pb2.GetResponse(key=key, header=header_to_proto(header), data=piece)
        else:
            yield kvstore_pb2.GetResponse(data=piece)


@dataclass
class Assembled:
    """One entry put back together; `pieces` add up to header.payload_length (checksum not yet checked)."""

    index: int
    key: bytes
    header: EntryHeader
    pieces: list[bytes] = field(default_factory=list)

    def payload(self) -> bytes:
        return self.pieces[0] if len(self.pieces) == 1 else b"".join(self.pieces)


class EntryAssembler:
    """Feed it messages of a Put or Get stream; it returns each entry once its last piece arrives.

    Raises CorruptEntry, naming the entry, when a message breaks the framing:
    data before any header, more data than the header's payload_length, a new
    entry before the previous one is complete, a header that fails validation
    (or promises more than `max_payload_bytes`, refused before any data is kept).
    """

    def __init__(self, max_payload_bytes: int | None = None) -> None:
        self.max_payload_bytes = max_payload_bytes
        self.count = 0  # entries started
        self._current: Assembled | None = None
        self._received = 0

    def _where(self, key: bytes | None = None) -> str:
        k = key if key is not None else (self._current.key if self._current else b"")
        return f"entry {max(self.count - 1, 0)} (key {k.hex()[:16]})"

    def feed(self, key: bytes, header: kvstore_pb2.EntryHeader | None, data: bytes) -> Assembled | None:
        if key:
            if self._current is not None:
                raise CorruptEntry(
                    f"{self._where()}: {self._received} of {self._current.header.payload_length} "
                    "payload bytes arrived before the next entry started"
                )
            self.count += 1
            if header is None:
                raise CorruptEntry(f"{self._where(key)}: the first message of an entry needs its header")
            try:
                parsed = header_from_proto(header, self.max_payload_bytes)
            except CorruptEntry as e:
                raise CorruptEntry(f"{self._where(key)}: {e}") from None
            self._current, self._received = Assembled(self.count - 1, key, parsed), 0
        elif self._current is None:
            if not data:
                return None  # e.g. a Put stream's lone fingerprint message
            raise CorruptEntry(f"{len(data)} payload bytes arrived with no entry header before them")
        current = self._current
        if self._received + len(data) > current.header.payload_length:
            raise CorruptEntry(
                f"{self._where()}: more payload than the header's payload_length "
                f"{current.header.payload_length}"
            )
        if data:
            current.pieces.append(data)
            self._received += len(data)
        if self._received == current.header.payload_length:
            self._current = None
            return current
        return None

    def finish(self) -> None:
        """The stream ended: raise CorruptEntry if an entry was left incomplete."""
        if self._current is not None:
            raise CorruptEntry(
                f"{self._where()}: the stream ended after {self._received} of "
                f"{self._current.header.payload_length} payload bytes"
            )


def entries_of(
    messages: Iterable[kvstore_pb2.GetResponse], max_payload_bytes: int | None = None
) -> Iterator[Assembled]:
    """The entries of a Get stream, in order (CorruptEntry on broken framing)."""
    assembler = EntryAssembler(max_payload_bytes)
    for msg in messages:
        done = assembler.feed(msg.key, msg.header if msg.HasField("header") else None, msg.data)
        if done is not None:
            yield done
    assembler.finish()


def check_entry_keys(entries: Sequence[EntryIn], fingerprint: bytes) -> None:
    """A client's own mistakes, caught before sending: headers of another fingerprint."""
    for i, (_, header, _) in enumerate(entries):
        if header.fingerprint != fingerprint:
            raise ValueError(f"entry {i}: header.fingerprint differs from the fingerprint of the call")
