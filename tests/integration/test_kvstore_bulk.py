"""KVStoreClient over a real store's bulk path (bulk="on" stands in for a store on another host)."""

from __future__ import annotations

import pytest

from kvstore_svc.client import KVStoreClient
from tests.helpers.kv_entries import FP, entry, key
from tests.integration.test_kvstore import StoreProcess


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = StoreProcess(tmp_path_factory.mktemp("kvstore-bulk"), "--memory-bytes", "64MiB")
    yield s
    assert s.stop() == 0, s.log.read_text()[-3000:]


def test_gets_go_over_the_bulk_path_and_equal_the_stream(store) -> None:
    ents = [entry(i, 4096 * (1 + i)) for i in range(4)]
    keys = [k for k, _, _ in ents] + [key(99)]
    with (
        KVStoreClient(store.address, shared_memory="off", bulk="on") as bulk,
        KVStoreClient(store.address, shared_memory="off", bulk="off") as stream,
    ):
        assert bulk.put(FP, ents) == 4
        before = bulk.stats()
        assert before.bulk_port > 0
        got = bulk.get(FP, keys)
        assert got == stream.get(FP, keys) == [(k, h, p) for k, h, p in ents]
        assert bulk.stats().bulk_bytes_out - before.bulk_bytes_out == sum(len(p) for _, _, p in ents)
        seen: list[bytes] = []
        assert bulk.get_each(FP, keys[:3], lambda k, h, p: seen.append(k) or len(seen) < 2) == 2
        assert seen == keys[:2]
