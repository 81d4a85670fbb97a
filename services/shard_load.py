"""How busy a scheduler shard's pool is: what the shard reports with its KV events and the
router scores it by (router.proto ShardLoad). One dataclass for both ends, here on the ground
floor, because the router imports no scheduler internals."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ShardLoad:
    queued_tokens: int = 0
    running: int = 0
    waiting: int = 0
    num_workers: int = 0
    num_blocks: int = 0
    backlog: int = 0
    max_backlog: int = 0
