"""Entries cut into messages and put back together; framing mistakes are refused early."""

from __future__ import annotations

import pytest

from kvstore_svc.wire import EntryAssembler, entries_of, get_responses, put_requests
from services.kv_entry import CorruptEntry, header_to_proto
from tests.helpers.kv_entries import FP, entry


def test_put_stream_cuts_pieces_and_names_the_fingerprint_once():
    entries = [entry(0, 10_000), entry(1, 4096)]
    msgs = list(put_requests(FP, entries, piece_bytes=4096))
    assert [len(m.data) for m in msgs] == [4096, 4096, 1808, 4096]
    assert [m.fingerprint for m in msgs] == [FP, b"", b"", b""]
    assert [bool(m.key) for m in msgs] == [True, False, False, True]
    assembler = EntryAssembler()
    done = [
        d for m in msgs if (d := assembler.feed(m.key, m.header if m.HasField("header") else None, m.data))
    ]
    assembler.finish()
    assert [(d.key, d.header, d.payload()) for d in done] == entries


def test_an_empty_put_stream_still_carries_the_fingerprint():
    (msg,) = put_requests(FP, [])
    assert msg.fingerprint == FP and not msg.key


def test_get_stream_round_trip():
    k, header, data = entry(3, 9000)
    msgs = list(get_responses(k, header, data, piece_bytes=4000))
    assert len(msgs) == 3
    (got,) = entries_of(msgs)
    assert (got.key, got.header, got.payload()) == (k, header, data)


def _proto(i: int = 0, nbytes: int = 4096):
    k, header, data = entry(i, nbytes)
    return k, header_to_proto(header), data


def test_data_before_any_header_is_refused():
    with pytest.raises(CorruptEntry, match="no entry header"):
        EntryAssembler().feed(b"", None, b"xx")


def test_more_data_than_the_header_promised_is_refused():
    k, h, data = _proto()
    a = EntryAssembler()
    a.feed(k, h, data[:100])
    with pytest.raises(CorruptEntry, match="more payload"):
        a.feed(b"", None, data[100:] + b"extra")


def test_a_new_entry_before_the_last_is_complete_is_refused():
    k, h, data = _proto()
    a = EntryAssembler()
    a.feed(k, h, data[:100])
    with pytest.raises(CorruptEntry, match="before the next entry"):
        a.feed(k, h, data)


def test_an_entry_cut_short_by_the_end_of_the_stream_is_refused():
    k, h, data = _proto()
    a = EntryAssembler()
    a.feed(k, h, data[:-1])
    with pytest.raises(CorruptEntry, match="stream ended"):
        a.finish()


def test_a_header_over_the_size_limit_is_refused_before_any_data_is_kept():
    k, h, _ = _proto()
    with pytest.raises(CorruptEntry, match="exceeds"):
        EntryAssembler(max_payload_bytes=1000).feed(k, h, b"")


def test_an_entry_without_its_header_is_refused():
    with pytest.raises(CorruptEntry, match="needs its header"):
        EntryAssembler().feed(b"key", None, b"")
