"""Generate the gRPC stubs once before any test imports them; fixtures every test folder may use."""

import os

import pytest

from services.gen_protos import ensure_stubs
from services.mesh_secret import ENV_KEY, new_key

ensure_stubs()
# Every service the tests start, and every client they open without saying otherwise, carries
# this session's mesh secret (as a deployment's environment would give it). Tests of what a
# stranger gets dial with `services.grpc_server.PLAINTEXT`; tests of `llmesh up`'s own fresh
# secret remove it from the environment they pass.
os.environ.setdefault(ENV_KEY, new_key())


@pytest.hookimpl(trylast=True)  # after -k/-m deselected what they do: the final selection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The long-idle test's `llmesh up` idles while the rest of the suite runs (75 s of make test).
    from tests.helpers.long_idle import start_with_the_session

    start_with_the_session(config, items)


@pytest.fixture
def redis_server(tmp_path_factory):
    """A fresh, empty redis-server on a free loopback port (skips if redis-server is not installed)."""
    from tests.helpers.redis_server import RedisServer

    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server
