"""Generate the gRPC stubs once before any test imports them; fixtures every test folder may use."""

import pytest

from services.gen_protos import ensure_stubs

ensure_stubs()


@pytest.fixture
def redis_server(tmp_path_factory):
    """A fresh, empty redis-server on a free loopback port (skips if redis-server is not installed)."""
    from tests.helpers.redis_server import RedisServer

    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server
