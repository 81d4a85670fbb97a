"""TLS and mutual TLS on a real grpc.aio server, with certificates made by the test (trustme)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from llmesh.v1 import generation_pb2, generation_pb2_grpc
from services.grpc_server import ChannelSecurity, GrpcServer, ServerConfig, Service, open_channel
from services.healthcheck import main as health_main
from services.healthcheck import target_of_command
from services.mesh_secret import client_key
from services.tls import TLSConfig
from tests.helpers.certs import MeshCerts, make_certs


class Scheduler(generation_pb2_grpc.SchedulerServicer):
    async def Tokenize(self, request, context):  # noqa: N802
        return generation_pb2.TokenizeResponse(token_ids=[len(request.text)])


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> MeshCerts:
    return make_certs(tmp_path_factory.mktemp("certs"))


async def _serve(**tls) -> GrpcServer:
    service = Service.of(
        "llmesh.v1.Scheduler", generation_pb2_grpc.add_SchedulerServicer_to_server, Scheduler()
    )
    server = GrpcServer([service], ServerConfig(**tls))
    await server.start()
    await server.set_serving()
    return server


async def _tokenize(address: str, security: ChannelSecurity | None) -> object:
    # TLS is what is tested; the mesh secret rides along as every service's channel carries it.
    security = dataclasses.replace(security or ChannelSecurity(), key=client_key())
    async with open_channel(address, security) as channel:
        try:
            resp = await generation_pb2_grpc.SchedulerStub(channel).Tokenize(
                generation_pb2.TokenizeRequest(text="abc"), timeout=5
            )
            return list(resp.token_ids)
        except grpc.aio.AioRpcError as e:
            return e.code()


async def test_tls_server_serves_verified_channels_only(certs) -> None:
    server = await _serve(tls_cert=certs.cert, tls_key=certs.key)
    try:
        assert await _tokenize(server.address, ChannelSecurity.of(TLSConfig(tls_ca=certs.ca))) == [3]
        # Plaintext to a TLS port, or a client that trusts another CA: no connection.
        assert await _tokenize(server.address, None) == grpc.StatusCode.UNAVAILABLE
        stranger_ca = TLSConfig(tls_ca=certs.other_cert)
        assert await _tokenize(server.address, ChannelSecurity.of(stranger_ca)) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_mutual_tls_needs_a_client_certificate_of_the_mesh_ca(certs) -> None:
    mtls = {"tls_cert": certs.cert, "tls_key": certs.key, "tls_ca": certs.ca, "tls_client_auth": True}
    server = await _serve(**mtls)
    try:
        assert await _tokenize(server.address, ChannelSecurity.of(TLSConfig(**mtls))) == [3]
        no_client_cert = ChannelSecurity.of(TLSConfig(tls_ca=certs.ca))
        assert await _tokenize(server.address, no_client_cert) == grpc.StatusCode.UNAVAILABLE
        foreign = TLSConfig(
            tls_cert=certs.other_cert, tls_key=certs.other_key, tls_ca=certs.ca, tls_client_auth=True
        )
        assert await _tokenize(server.address, ChannelSecurity.of(foreign)) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_server_name_checks_a_mesh_certificate_dialled_by_address(certs) -> None:
    server = await _serve(tls_cert=certs.named_cert, tls_key=certs.named_key)
    try:
        by_address = ChannelSecurity.of(TLSConfig(tls_ca=certs.ca))
        assert await _tokenize(server.address, by_address) == grpc.StatusCode.UNAVAILABLE
        by_name = ChannelSecurity.of(TLSConfig(tls_ca=certs.ca, tls_server_name="llmesh-mesh"))
        assert await _tokenize(server.address, by_name) == [3]
    finally:
        await server.stop(0)


def test_tls_flags_are_checked_together(certs) -> None:
    with pytest.raises(ValueError, match="go together"):
        TLSConfig(tls_cert=certs.cert)
    with pytest.raises(ValueError, match="client-auth needs"):
        TLSConfig(tls_cert=certs.cert, tls_key=certs.key, tls_client_auth=True)
    with pytest.raises(ValueError, match="no such file"):
        TLSConfig(tls_ca="/nonexistent/ca.pem")
    assert not TLSConfig().tls_dials and TLSConfig(tls_ca=certs.ca).tls_dials


async def test_llmesh_health_probes_a_tls_server_from_a_command_line_and_env(certs) -> None:
    """What a container's HEALTHCHECK does: read the service's flags and environment, then probe."""
    import asyncio

    server = await _serve(tls_cert=certs.cert, tls_key=certs.key, tls_ca=certs.ca, tls_client_auth=True)
    try:
        env = {"LLMESH_TLS_CA": certs.ca, "LLMESH_TLS_CLIENT_AUTH": "1"}
        command = ["llmesh", "scheduler", "--host", "0.0.0.0", "--port", str(server.port)]
        command += ["--tls-cert", certs.cert, f"--tls-key={certs.key}"]
        target = target_of_command(command, env)
        assert target.address == f"127.0.0.1:{server.port}" and target.tls.tls_client_auth
        assert target.tls.tls_cert == certs.cert and not target.http
        flags = ["--tls-ca", certs.ca, "--tls-cert", certs.cert, "--tls-key", certs.key, "--tls-client-auth"]
        assert await asyncio.to_thread(health_main, [server.address, *flags], {}) == 0
        assert await asyncio.to_thread(health_main, [server.address, "--tls-ca", certs.ca], {}) == 1
    finally:
        await server.stop(0)
    gateway = target_of_command(["/usr/bin/python", "-m", "gateway.service"], {"LLMESH_GATEWAY_PORT": "9"})
    assert gateway.http and gateway.address == "127.0.0.1:9"


def test_llmesh_health_reads_a_router_command_line() -> None:
    """The router's probe in the TLS component is `llmesh health` on its own command line."""
    router = target_of_command(["llmesh", "router", "--host", "0.0.0.0", "--port", "50051"], {})
    assert router.address == "127.0.0.1:50051" and not router.http
    by_module = target_of_command(["python3", "-m", "router_svc.service"], {"LLMESH_ROUTER_PORT": "7"})
    assert by_module.address == "127.0.0.1:7"
