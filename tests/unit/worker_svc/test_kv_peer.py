"""A direct handover's transport on the CPU (worker_svc/kv_peer.py): a cache in a shared-memory
segment, exported through protobuf, opened and copied by a peer; every way the copy cannot be
done is a per-sequence failure (computed instead), never a wrong byte."""

from __future__ import annotations

import dataclasses
import os
import stat

import pytest
import torch

from services.convert import (
    kv_export_from_proto,
    kv_export_to_proto,
    peer_copy_from_proto,
    peer_copy_to_proto,
)
from services.step import PeerCopy
from worker_svc.kv_peer import PeerCopier, SharedKVSegment, _runs, export_caches

SHAPE = (2, 12, 4, 2, 8)  # [K/V, blocks, block_size, heads, head_dim]
LAYERS = 3


@pytest.fixture
def segment():
    seg = SharedKVSegment(SHAPE, torch.float32, LAYERS)
    for t in seg.tensors:
        t.copy_(torch.randn(SHAPE))
    yield seg
    seg.close()


def copier(blocks: int = 10) -> PeerCopier:
    return PeerCopier([torch.zeros(2, blocks, *SHAPE[2:]) for _ in range(LAYERS)], torch.device("cpu"))


def test_the_segment_is_private_and_unlinked_at_close():
    seg = SharedKVSegment(SHAPE, torch.float32, LAYERS)
    assert stat.S_IMODE(os.stat(seg.path).st_mode) == 0o600
    assert all(not t.any() for t in seg.tensors)  # zero-filled, as allocate_kv_cache's
    seg.close()
    assert not os.path.exists(seg.path)
    seg.close()  # idempotent


@pytest.mark.parametrize(
    "src, dst", [([3, 4, 5, 9], [0, 1, 2, 7]), (list(range(9, -1, -1)), list(range(10)))]
)
def test_blocks_are_copied_through_the_wire_form(segment, src, dst):
    """Slices for a few runs, a gather and a scatter for many (here ten runs of one block)."""
    export = kv_export_from_proto(kv_export_to_proto(export_caches(list(segment.tensors), segment)))
    assert export.kind == "shm" and export.num_layers == LAYERS
    copy = peer_copy_from_proto(peer_copy_to_proto(PeerCopy("s", export, src, dst)))
    peer = copier()
    report = peer.apply([copy], lambda seq_id, block: dst.index(block))
    assert not report.failed and report.nbytes == len(src) * LAYERS * 2 * 4 * 2 * 8 * 4
    for theirs, mine in zip(segment.tensors, peer.caches, strict=True):
        assert torch.equal(mine[:, dst], theirs[:, src])


def test_a_copy_that_cannot_be_done_fails_that_sequence_only(segment):
    export = export_caches(list(segment.tensors), segment)
    gone = dataclasses.replace(export, export_id="gone", shm_name="llmesh-kv-gone")
    other_host = dataclasses.replace(export, export_id="far", host_id="elsewhere")
    wider = dataclasses.replace(export, export_id="wide", layer_shape=[2, 12, 4, 4, 8])
    escape = dataclasses.replace(export, export_id="escape", shm_name="../etc/passwd")
    copies = [
        PeerCopy("ok", export, [1, 2], [1, 2]),
        PeerCopy("src out of range", export, [12], [3]),
        PeerCopy("dst out of range", export, [1], [10]),
        PeerCopy("gone", gone, [1], [4]),
        PeerCopy("other host", other_host, [1], [5]),
        PeerCopy("layout", wider, [1], [6]),
        PeerCopy("escape", escape, [1], [7]),
    ]
    peer = copier()
    report = peer.apply(copies, lambda seq_id, block: block)
    assert report.failed == {c.seq_id: c.dst_block_ids[0] for c in copies[1:]}
    assert torch.equal(peer.caches[0][:, 1:3], segment.tensors[0][:, 1:3])
    assert not peer.caches[0][:, 3:].any()  # nothing else written


def test_runs_join_consecutive_pairs_only():
    assert _runs([5, 6, 7, 1, 2], [0, 1, 2, 3, 4]) == [(5, 0, 3), (1, 3, 2)]
    assert _runs([1, 2], [4, 6]) == [(1, 4, 1), (2, 6, 1)]
