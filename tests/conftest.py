"""Generate the gRPC stubs once before any test imports them; fixtures every test folder may use."""

import os

import pytest

from services.gen_protos import ensure_stubs
from services.mesh_secret import ENV_KEY, new_key
from services.ports import ENV_RANGE, pick_range

ensure_stubs()
# Every service the tests start, and every client they open without saying otherwise, carries
# this session's mesh secret (as a deployment's environment would give it). Tests of what a
# stranger gets dial with `services.grpc_server.PLAINTEXT`; tests of `llmesh up`'s own fresh
# secret remove it from the environment they pass.
os.environ.setdefault(ENV_KEY, new_key())


def _port_slice_of_this_xdist_worker() -> None:
    """`make test` runs two pytest-xdist workers: each (and every service it starts) picks free
    ports from a slice of its own, so that neither takes a port the other has picked for a child
    that has not bound it yet (services.ports)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or ENV_RANGE in os.environ:
        return  # one process, or a range the caller chose
    span = pick_range()
    if span is None:
        return  # too few ports below the ephemeral range to share: the kernel's picks
    index, (lo, hi) = int(worker[2:]), span
    width = (hi - lo + 1) // count
    os.environ[ENV_RANGE] = f"{lo + index * width}-{lo + (index + 1) * width - 1}"


_port_slice_of_this_xdist_worker()


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
