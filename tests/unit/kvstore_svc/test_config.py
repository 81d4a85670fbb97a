"""KVStoreConfig from flags and the environment."""

from __future__ import annotations

import os

import pytest

from kvstore_svc.config import KVStoreConfig, kvstore_environ
from services.config import ByteSize, load_config


def load(argv: list[str], env: dict[str, str] | None = None) -> KVStoreConfig:
    return load_config(KVStoreConfig, argv, kvstore_environ(env or {}), service="kvstore")


def test_defaults_are_a_private_memory_store():
    cfg = load([])
    assert cfg.host == "127.0.0.1" and cfg.memory_bytes == 2 << 30
    assert not cfg.disk_dir and not cfg.redis_url and not cfg.write_behind


def test_sizes_take_units():
    cfg = load(["--memory-bytes", "512MiB", "--disk-dir", "/tmp/x", "--disk-bytes", "1.5G"])
    assert cfg.memory_bytes == 512 << 20 and cfg.disk_bytes == 1_500_000_000
    assert isinstance(cfg.memory_bytes, ByteSize)
    assert load([], {"LLMESH_KVSTORE_MAX_ENTRY_BYTES": "2Mi"}).max_entry_bytes == 2 << 20


def test_redis_url_falls_back_to_redis_url_and_service_scoped_wins():
    assert load([], {"REDIS_URL": "redis://:p@a:1/0"}).redis_url == "redis://:p@a:1/0"
    env = {"REDIS_URL": "redis://:p@a:1/0", "LLMESH_KVSTORE_REDIS_URL": "redis://u:p@b:2/0"}
    assert load([], env).redis_url == "redis://u:p@b:2/0"
    assert load(["--redis-url", "redis://:p@c:3/0"], env).redis_url == "redis://:p@c:3/0"


@pytest.mark.parametrize(
    "argv",
    [
        ["--memory-bytes", "lots"],
        ["--memory-bytes", "0"],  # and no other tier
        ["--redis-timeout-s", "0"],
        ["--max-entry-bytes", "0"],
        ["--max-message-bytes", "1000"],
        ["--io-threads", "0"],
        ["--redis-url", "localhost:6379"],
    ],
)
def test_bad_values_are_usage_errors(argv):
    with pytest.raises(SystemExit) as e:
        load(argv)
    assert e.value.code == 2


def test_the_memory_tier_is_an_arena_unless_told_or_unable():
    from kvstore_svc import shm
    from kvstore_svc.store import memory_tier
    from kvstore_svc.tiers.arena import ArenaMemoryTier
    from kvstore_svc.tiers.memory import MemoryTier

    if not shm.available():
        pytest.skip("no /dev/shm")
    tier = memory_tier(load(["--memory-bytes", "1MiB", "--lease-timeout-s", "3"]))
    assert isinstance(tier, ArenaMemoryTier) and tier.lease_timeout_s == 3
    tier.close()
    for argv in (["--no-memory-arena"], ["--no-shared-memory"]):
        assert isinstance(memory_tier(load(["--memory-bytes", "1MiB", *argv])), MemoryTier)
    st = os.statvfs(shm.SHM_DIR)
    too_big = str(st.f_bavail * st.f_frsize + (1 << 30))  # more than /dev/shm holds: the heap
    assert isinstance(memory_tier(load(["--memory-bytes", too_big])), MemoryTier)
    with pytest.raises(SystemExit):  # a usage error naming the flag
        load(["--lease-timeout-s", "0"])
