"""The KV store service's configuration: one dataclass, from CLI flags and the environment.

`llmesh kvstore --memory-bytes 4GiB --disk-dir /var/cache/llmesh-kv --redis-url redis://r:6379/0`;
every flag also reads `LLMESH_KVSTORE_<NAME>` / `LLMESH_<NAME>`, and the Redis
URL falls back to `REDIS_URL` (what docker and Kubernetes setups usually set).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from services.config import ByteSize, option
from services.grpc_server import ServerConfig

# Payload piece per Put/Get message: well under gRPC's default 4 MiB message limit, so that any
# client with default settings can talk to the store, and large enough that per-message costs vanish.
PIECE_BYTES = 1 << 20


@dataclass
class KVStoreConfig(ServerConfig):
    """The tiered KV store: memory LRU -> local disk -> Redis (shared by every store)."""

    # Entries travel in 1 MiB pieces; a message of more than a few pieces is a broken or hostile client.
    max_message_bytes: int = option(8 << 20, help="largest gRPC message sent or received, in bytes")
    memory_bytes: ByteSize = option(
        ByteSize("2GiB"), help="memory tier budget (e.g. 2GiB); 0 = no memory tier"
    )
    disk_dir: str = option("", help="directory of the disk tier (kept across restarts); empty = no disk tier")
    disk_bytes: ByteSize = option(ByteSize("10GiB"), help="disk tier budget")
    redis_url: str = option("", help="redis://[:password@]host:port/db of the shared tier (or env REDIS_URL)")
    redis_timeout_s: float = option(0.5, help="socket timeout of each Redis call; slower counts as a miss")
    redis_retry_after_s: float = option(3.0, help="after a Redis failure, skip Redis this long, then retry")
    redis_ttl_s: int = option(
        0, help="expire Redis entries unread for this long; 0 = never (maxmemory evicts)"
    )
    write_behind: bool = option(
        False,
        help="acknowledge puts once in memory and write disk/Redis from a queue (default: write-through)",
    )
    write_behind_bytes: ByteSize = option(
        ByteSize("256MiB"), help="write-behind queue bound; writes beyond it are dropped (counted)"
    )
    max_entry_bytes: ByteSize = option(ByteSize("64MiB"), help="largest entry payload Put accepts")
    shared_memory: bool = option(
        True,
        help="serve GetShared/PutShared: clients on this host move payloads through their shared memory "
        "segments (/dev/shm/llmesh-kv-*) instead of gRPC; --no-shared-memory refuses them "
        "(FAILED_PRECONDITION: clients stream)",
    )
    memory_arena: bool = option(
        True,
        help="with shared memory on, keep the memory tier in one arena file the store owns "
        "(/dev/shm/llmesh-kvstore-*, mode 0600, committed at start): workers of the same user on this "
        "host read entries where they lie (GetInPlace); --no-memory-arena keeps it in the heap",
    )
    lease_timeout_s: float = option(
        10.0, help="an in-place read's lease not released within this long expires (its worker died)"
    )
    io_threads: int = option(8, help="threads for tier I/O (disk, Redis), off the event loop")
    log_level: str = option("info", help="debug | info | warning | error")

    def __post_init__(self) -> None:
        ServerConfig.__post_init__(self)
        if self.max_message_bytes < 2 * PIECE_BYTES:
            raise ValueError(
                f"max_message_bytes must be >= {2 * PIECE_BYTES} (pieces are {PIECE_BYTES} bytes)"
            )
        if self.disk_dir and self.disk_bytes <= 0:
            raise ValueError("disk_bytes must be > 0 with a disk_dir")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        if self.redis_timeout_s <= 0 or self.redis_retry_after_s <= 0:
            raise ValueError("redis_timeout_s and redis_retry_after_s must be > 0")
        if self.redis_ttl_s < 0:
            raise ValueError(f"redis_ttl_s must be >= 0, got {self.redis_ttl_s}")
        if self.write_behind and self.write_behind_bytes <= 0:
            raise ValueError("write_behind_bytes must be > 0 with write_behind")
        if self.max_entry_bytes <= 0:
            raise ValueError(f"max_entry_bytes must be > 0, got {self.max_entry_bytes}")
        if self.lease_timeout_s <= 0:
            raise ValueError(f"lease_timeout_s must be > 0, got {self.lease_timeout_s}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")
        if not (self.memory_bytes or self.disk_dir or self.redis_url):
            raise ValueError("no tier configured: give --memory-bytes > 0, --disk-dir or --redis-url")


def kvstore_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment load_config reads, with REDIS_URL as the fallback for --redis-url."""
    env = dict(os.environ if environ is None else environ)
    if "REDIS_URL" in env:
        env.setdefault("LLMESH_REDIS_URL", env["REDIS_URL"])  # the LLMESH_ names still win
    return env
