"""A store load over the bulk path into a CUDA worker, in rounds of its pinned staging (issue 32).

The store is a real `llmesh kvstore` process on loopback, reached as one on another host would be
(transfer="bulk": no shared memory). The load runs under inference mode, as the step does
(`ModelRunner.launch`): its uploads, queued by the transfer threads, must land all the same.
The loaded blocks equal the blocks that were put (what a recompute would write), byte for byte.
"""

from __future__ import annotations

import logging

import pytest
import torch

from services.step import KVTransfers, StoreLoad, StorePut
from tests.gpu.test_kv_tiers_gpu import blocks_of, make_tiers
from worker_svc.kv_load_staging import LoadStaging

pytestmark = pytest.mark.gpu

CHUNKS = 5  # chunks of 4 blocks; the staging holds 2: rounds of 2, 2 and 1


def test_a_multi_round_bulk_load_lands_every_chunk_exactly(tmp_path, caplog) -> None:
    from kvstore_svc.client import KVStoreClient
    from tests.integration.test_kvstore import StoreProcess

    store = StoreProcess(tmp_path, "--memory-bytes", "256MiB")
    client = KVStoreClient(store.address, timeout_s=30, transfer="bulk")
    try:
        tiers = make_tiers(client, chunk_blocks=4)
        assert tiers.load_staging is not None
        s = tiers.load_staging
        tiers.load_staging = LoadStaging(s.chunk_shape, s.dtype, 2 * s.chunk_bytes)
        ids = list(range(1, 1 + 4 * CHUNKS))
        want = blocks_of(tiers, ids).clone()
        keys = [bytes([65 + i]) * 32 for i in range(CHUNKS)]
        puts = [StorePut(k, ids[4 * i : 4 * i + 4]) for i, k in enumerate(keys)]
        tiers.apply(KVTransfers(store_puts=puts), lambda s, b: 0)
        tiers.flush()
        for c in tiers.kv_caches:  # fresh device memory must not hold the chunks by chance
            c[:, ids] = 0
        torch.cuda.empty_cache()
        targets = list(range(30, 30 + 4 * CHUNKS))
        caplog.set_level(logging.WARNING)
        with torch.inference_mode():  # as the step runs it
            failed = tiers.apply(KVTransfers(store_loads=[StoreLoad("s", keys, targets)]), lambda s, b: 0)
            torch.cuda.synchronize()
        assert not [r for r in caplog.records if "upload failed" in r.getMessage()]
        assert failed == {}
        c = tiers.counters
        assert c.store_bulk_loads == 1 and c.store_verify_failures == 0
        assert c.store_loaded_blocks == 4 * CHUNKS
        assert torch.equal(blocks_of(tiers, targets), want)
        tiers.close()
    finally:
        client.close()
        store.stop()
