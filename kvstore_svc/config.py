"""The KV store service's configuration: one dataclass, from CLI flags and the environment.

`llmesh kvstore --memory-bytes 4GiB --disk-dir /var/cache/llmesh-kv`, with
`REDIS_URL=redis://llmesh@r:6379/0 LLMESH_KVSTORE_REDIS_PASSWORD_FILE=/secrets/redis-password`;
every flag also reads `LLMESH_KVSTORE_<NAME>` / `LLMESH_<NAME>`, and the Redis
URL falls back to `REDIS_URL` (what docker and Kubernetes setups usually set).

Redis is shared, untrusted storage: a URL without credentials is refused unless
`--redis-allow-anonymous` says that Redis is one nobody else can reach. After
`__post_init__`, `redis_url` is the URL the tier connects with: the password
from `--redis-password-file` and the `--redis-tls-*` files folded in (log it
only through `redact_url`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvstore_svc.tiers.redis_url import (
    SCHEMES,
    has_credentials,
    password_of,
    read_password_file,
    redact_url,
    with_password,
    with_query,
)
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
    redis_url: str = option(
        "",
        secret=True,  # it may hold the password: `llmesh up` hands it over in the environment
        help="redis[s]://[USER[:PASSWORD]@]host:port/db of the shared tier (or env REDIS_URL; keep a "
        "password out of argv: the environment or --redis-password-file)",
    )
    redis_password_file: str = option(
        "", help="file holding the Redis password (a mounted Secret), whitespace stripped; URL without one"
    )
    redis_allow_anonymous: bool = option(
        False,
        help="accept a Redis URL without credentials (anyone reaching that Redis can read and rewrite "
        "the cache: only for a Redis nobody else can reach)",
    )
    redis_tls_ca: str = option("", help="CA bundle (PEM) verifying a rediss:// server; default: system CAs")
    redis_tls_cert: str = option("", help="client certificate (PEM) for a rediss:// server that asks for one")
    redis_tls_key: str = option("", help="private key (PEM) of --redis-tls-cert")
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
    bulk_port: int = option(
        0,
        help="port of the bulk path on --host (kvstore_svc/bulk.py): clients on other hosts get entries "
        "over plain TCP at link speed, authenticated by the mesh key (advertised in Stats); 0 = any "
        "free port, -1 = off (clients stream over gRPC). Off under --tls-cert: it has no TLS",
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
        self.redis_url = self._redis_connect_url()
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
        if not -1 <= self.bulk_port <= 65535:
            raise ValueError(f"bulk_port must be -1 (off) or in [0, 65535], got {self.bulk_port}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")
        if not (self.memory_bytes or self.disk_dir or self.redis_url):
            raise ValueError("no tier configured: give --memory-bytes > 0, --disk-dir or --redis-url")

    def _redis_tls_files(self) -> dict[str, str]:
        """The TLS files given, under the names redis-py reads from a URL's query."""
        named = {
            "ssl_ca_certs": ("--redis-tls-ca", self.redis_tls_ca),
            "ssl_certfile": ("--redis-tls-cert", self.redis_tls_cert),
            "ssl_keyfile": ("--redis-tls-key", self.redis_tls_key),
        }
        for flag, path in named.values():
            if path and not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file")
        if bool(self.redis_tls_cert) != bool(self.redis_tls_key):
            raise ValueError("--redis-tls-cert and --redis-tls-key go together")
        return {param: path for param, (_, path) in named.items() if path}

    def _redis_connect_url(self) -> str:
        """The URL the Redis tier connects with: checked, the password file and TLS files folded in.

        Idempotent (a config rebuilt from its own fields gets the same URL).
        """
        url = self.redis_url
        extras = self.redis_password_file or self.redis_tls_ca or self.redis_tls_cert or self.redis_tls_key
        if not url:
            if extras:
                raise ValueError("--redis-password-file and --redis-tls-* need --redis-url (or REDIS_URL)")
            return url
        if not url.startswith(SCHEMES):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        if self.redis_password_file:
            password = read_password_file(self.redis_password_file)
            if password_of(url) not in (None, password):
                raise ValueError(
                    f"{redact_url(url)} has a password and --redis-password-file gives another: keep one"
                )
            url = with_password(url, password)
        tls = self._redis_tls_files()
        if tls:
            if not url.startswith("rediss://"):
                raise ValueError("--redis-tls-ca/--redis-tls-cert/--redis-tls-key need a rediss:// URL")
            url = with_query(url, tls)
        if not has_credentials(url) and not self.redis_allow_anonymous:
            raise ValueError(anonymous_redis_message(url))
        return url


def anonymous_redis_message(url: str) -> str:
    """Why an anonymous Redis URL is refused, and the ways to fix it."""
    return (
        f"refusing Redis {redact_url(url)} without credentials: anyone who reaches it could read "
        "and rewrite the KV cache. Run Redis with a password (requirepass, or an ACL user) and give it "
        "as redis://USER:PASSWORD@host:port/db in $REDIS_URL (not on the command line), or put the "
        "password in a file named by --redis-password-file (LLMESH_KVSTORE_REDIS_PASSWORD_FILE) with "
        "redis://USER@host:port/db; or, for a Redis nobody else can reach, pass --redis-allow-anonymous "
        "(LLMESH_KVSTORE_REDIS_ALLOW_ANONYMOUS=1)"
    )


def kvstore_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment load_config reads, with REDIS_URL as the fallback for --redis-url."""
    env = dict(os.environ if environ is None else environ)
    if "REDIS_URL" in env:
        env.setdefault("LLMESH_REDIS_URL", env["REDIS_URL"])  # the LLMESH_ names still win
    return env
