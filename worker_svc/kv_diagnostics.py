"""Diagnostic switches of the worker's KV store memory (issue 32), read from the environment.

Not options: they exist so that one benchmark process can split the hypotheses of why a
store-attached worker answers a short prompt late while it loads nothing (benchmarks/kv_store.py
`--variants`). Each turns off one page-locking of host memory, at the cost of slower copies:

    LLMESH_KV_DIAG_NO_ARENA_LOCK=1     the store's arena mapping is not cudaHostRegister'ed
    LLMESH_KV_DIAG_NO_SEGMENT_LOCK=1   the store client's shared memory segments are not either
    LLMESH_KV_DIAG_PAGEABLE_LOAD=1     the bulk path's load staging is pageable, not pinned
    LLMESH_KV_DIAG_PAGEABLE_PUT=1      the put staging is not one pinned pool (per-put buffers)

Read when a worker's KV tiers are made (each engine), so a process can flip them between engines.
"""

from __future__ import annotations

import os

SWITCHES = (
    "LLMESH_KV_DIAG_NO_ARENA_LOCK",
    "LLMESH_KV_DIAG_NO_SEGMENT_LOCK",
    "LLMESH_KV_DIAG_PAGEABLE_LOAD",
    "LLMESH_KV_DIAG_PAGEABLE_PUT",
)


def diag(name: str) -> bool:
    """Whether diagnostic switch `name` (one of SWITCHES) is on."""
    assert name in SWITCHES, name
    return os.environ.get(name, "") not in ("", "0")
