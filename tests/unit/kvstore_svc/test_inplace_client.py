"""The client's checks on reads in place: which arenas it maps, and which entries it refuses."""

from __future__ import annotations

import os

import pytest

from kvstore_svc.arena import ArenaFile
from kvstore_svc.inplace_client import ArenaMap, _checked
from kvstore_svc.shared_client import SharedRefused
from llmesh.v1 import kvstore_pb2 as kv
from services.kv_entry import CorruptEntry, header_to_proto
from tests.helpers.kv_entries import FP, OTHER_FP, entry


def test_the_arena_is_mapped_read_only(tmp_path):
    arena = ArenaFile(1 << 16, str(tmp_path))
    try:
        arena.commit(arena.size)
        arena.view[:5] = b"hello"
        m = ArenaMap(arena.name, arena.size, str(tmp_path))
        assert bytes(m.view[:5]) == b"hello" and m.view.readonly and m.address
        with pytest.raises(TypeError):
            m.view[0:1] = b"x"
        m.close()
    finally:
        arena.close()


def test_arenas_of_another_size_name_or_kind_are_refused(tmp_path):
    arena = ArenaFile(1 << 16, str(tmp_path))
    try:
        with pytest.raises(SharedRefused, match="regular file"):
            ArenaMap(arena.name, arena.size * 2, str(tmp_path))
        with pytest.raises(ValueError):
            ArenaMap("../" + arena.name, arena.size, str(tmp_path))
        link = "llmesh-kvstore-1-0123456789abcdef"
        os.symlink(arena.path, tmp_path / link)
        with pytest.raises(SharedRefused):  # no links
            ArenaMap(link, arena.size, str(tmp_path))
        with pytest.raises(SharedRefused, match="cannot open"):  # gone, or another host's
            ArenaMap("llmesh-kvstore-2-0123456789abcdef", arena.size, str(tmp_path))
    finally:
        arena.close()


def _msg(k, h, offset):
    return kv.InPlaceEntry(key=k, header=header_to_proto(h), offset=offset)


@pytest.mark.parametrize(
    "case, offset, want, fp, match",
    [
        ("past the arena's end", 4160, None, FP, "outside the arena"),
        ("misaligned", 65, None, FP, "outside the arena"),
        ("another key", 0, b"other", FP, "keys in order"),
        ("another fingerprint", 0, None, OTHER_FP, "fingerprint"),
    ],
)
def test_entries_outside_the_arena_or_not_asked_for_are_refused(case, offset, want, fp, match):
    k, h, _ = entry(0, 4096)
    with pytest.raises(CorruptEntry, match=match):
        _checked(_msg(k, h, offset), want or k, fp, 8192)


def test_an_entry_that_ends_at_the_arenas_end_is_accepted():
    k, h, _ = entry(0, 4096)
    assert _checked(_msg(k, h, 4096), k, FP, 8192) == h
