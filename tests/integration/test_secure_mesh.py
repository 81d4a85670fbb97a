"""A mesh with every security option on: mutual TLS between all services, the internal key on
every internal RPC, the API key on the gateway and on the scheduler's public gRPC API.

Loopback processes started by `start_mesh` with the environment `llmesh up --api-key ...
--internal-key ... --tls-* --tls-client-auth` gives them; certificates made by the test.
"""

from __future__ import annotations

import grpc
import openai
import pytest

from llmesh.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.grpc_server import ChannelSecurity, open_sync_channel
from services.launcher import LocalMesh, start_mesh
from services.tls import TLSConfig
from tests.helpers.certs import make_certs
from tests.integration.conftest import service_logs

API_KEY, INTERNAL_KEY = "api-secret", "internal-secret-of-the-test"


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    folder = tmp_path_factory.mktemp("secure-mesh")
    certs = make_certs(folder)
    env = {
        "LLMESH_GATEWAY_API_KEY": API_KEY,
        "LLMESH_SCHEDULER_API_KEY": API_KEY,
        "LLMESH_INTERNAL_KEY": INTERNAL_KEY,
        "LLMESH_TLS_CERT": certs.cert,
        "LLMESH_TLS_KEY": certs.key,
        "LLMESH_TLS_CA": certs.ca,
        "LLMESH_TLS_CLIENT_AUTH": "1",
    }
    try:
        mesh = start_mesh(
            1,
            gateway_port=0,
            kvstore=True,
            kvstore_args=["--memory-bytes", "64MiB"],
            worker_args=["--kv-cache-memory", str(64 << 20)],
            env=env,
            log_dir=str(folder),
        )
    except Exception as e:
        raise RuntimeError(f"the secure mesh did not start: {e}\n{service_logs(folder)}") from e
    mtls = TLSConfig(tls_cert=certs.cert, tls_key=certs.key, tls_ca=certs.ca, tls_client_auth=True)
    yield mesh, certs, mtls
    mesh.stop()


def test_the_gateway_serves_over_the_mutual_tls_mesh_with_its_key(secure) -> None:
    mesh, _, _ = secure
    url = f"http://{mesh.gateway.address}/v1"
    client = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=120)
    resp = client.completions.create(
        model=None, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert resp.usage.completion_tokens == 4 and resp.choices[0].text
    with pytest.raises(openai.AuthenticationError):  # 401 without the key
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()


def _code(call) -> object:
    try:
        return call()
    except grpc.RpcError as e:
        return e.code()


def test_grpc_calls_without_the_key_are_refused(secure) -> None:
    mesh: LocalMesh
    mesh, _, mtls = secure
    tokenize = generation_pb2.TokenizeRequest(text="hello")
    with open_sync_channel(mesh.scheduler.address, ChannelSecurity.of(mtls)) as channel:
        scheduler = generation_pb2_grpc.SchedulerStub(channel)
        assert _code(lambda: scheduler.Tokenize(tokenize, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        stats = worker_pb2_grpc.RegistryStub(channel).GetStats
        assert (
            _code(lambda: stats(worker_pb2.GetStatsRequest(), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        )
    # The API key opens the public API, not the Registry (that takes the internal key).
    with open_sync_channel(mesh.scheduler.address, ChannelSecurity.of(mtls, API_KEY)) as channel:
        assert list(generation_pb2_grpc.SchedulerStub(channel).Tokenize(tokenize, timeout=10).token_ids)
        stats = worker_pb2_grpc.RegistryStub(channel).GetStats
        assert (
            _code(lambda: stats(worker_pb2.GetStatsRequest(), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        )
    for address, call in (
        (
            mesh.workers[0].address,
            lambda ch: worker_pb2_grpc.WorkerStub(ch).GetWorkerInfo(
                worker_pb2.GetWorkerInfoRequest(), timeout=10
            ),
        ),
        (
            mesh.kvstore.address,
            lambda ch: kvstore_pb2_grpc.KVStoreStub(ch).Stats(kvstore_pb2.StatsRequest(), timeout=10),
        ),
    ):
        with open_sync_channel(address, ChannelSecurity.of(mtls, API_KEY)) as channel:
            assert _code(lambda ch=channel, c=call: c(ch)) == grpc.StatusCode.UNAUTHENTICATED
        with open_sync_channel(address, ChannelSecurity.of(mtls, INTERNAL_KEY)) as channel:
            assert not isinstance(_code(lambda ch=channel, c=call: c(ch)), grpc.StatusCode)


def test_no_client_certificate_no_connection(secure) -> None:
    mesh, certs, _ = secure
    server_only = ChannelSecurity.of(TLSConfig(tls_ca=certs.ca), INTERNAL_KEY)
    with open_sync_channel(mesh.scheduler.address, server_only) as channel:
        info = generation_pb2_grpc.SchedulerStub(channel).GetModelInfo
        assert (
            _code(lambda: info(generation_pb2.GetModelInfoRequest(), timeout=5))
            == grpc.StatusCode.UNAVAILABLE
        )
