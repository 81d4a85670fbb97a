"""Stored responses (gateway/response_store.py): memory bounded by size and age; Redis (a real
redis-server with a password, under deploy/'s ACL user) shared by every store that points at it."""

from __future__ import annotations

import pytest

from gateway.response_store import REDIS_PREFIX, MemoryResponseStore, RedisResponseStore, open_store
from tests.helpers.clock import Clock
from tests.helpers.redis_server import RedisServer


async def test_memory_store_bounds_and_copies():
    clock = Clock()
    store = MemoryResponseStore(max_entries=2, ttl_s=10, clock=clock)
    record = {"response": {"id": "a"}, "history": [{"role": "user", "content": "hi"}]}
    await store.put("a", record)
    got = await store.get("a")
    assert got == record and got is not record  # JSON text inside: a copy, never shared state
    got["history"].clear()
    assert (await store.get("a"))["history"]
    await store.put("b", {"n": 2})
    await store.put("c", {"n": 3})  # past max_entries: the oldest goes
    assert await store.get("a") is None and len(store) == 2
    clock.now += 11  # past the TTL: every record goes
    assert await store.get("b") is None and len(store) == 0
    await store.put("d", {"n": 4})
    assert await store.delete("d") and not await store.delete("d")
    with pytest.raises(ValueError):
        MemoryResponseStore(max_entries=0, ttl_s=1)
    with pytest.raises(TypeError):
        await store.put("e", {"not json": object()})  # never pickled: only JSON goes in


async def test_redis_store_is_shared_and_expires(tmp_path):
    with RedisServer(tmp_path, user="llmesh") as server:
        one, two = open_store(server.url, 1, 60), open_store(server.url, 1, 60)
        assert isinstance(one, RedisResponseStore)
        try:
            await one.put("r1", {"response": {"id": "r1"}, "history": []})
            assert await two.get("r1") == {"response": {"id": "r1"}, "history": []}
            admin = server.client()
            assert 0 < admin.ttl(REDIS_PREFIX + "r1") <= 60
            assert admin.get(REDIS_PREFIX + "r1").startswith(b"{")  # JSON, readable by anyone's tools
            admin.set(REDIS_PREFIX + "junk", b"\x80\x04not json")
            assert await two.get("junk") is None
            assert await two.delete("r1") and await one.get("r1") is None
        finally:
            await one.close()
            await two.close()
        server.kill()
        down = RedisResponseStore(server.url, 60)
        with pytest.raises(Exception) as e:
            await down.get("r1")
        assert getattr(e.value, "status", None) == 503 and server.password not in str(e.value)
        await down.close()
