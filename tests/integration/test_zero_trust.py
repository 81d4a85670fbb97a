"""Zero trust inside the default mesh (issue 28): `llmesh up --api-key K`, no other security flag.

The mesh is started from the CLI's own parsing of that command line (`up_kwargs`), in an
environment without a mesh secret, so that `start_mesh` makes the fresh per-mesh key itself.
Every RPC of every service in protos/llmesh/v1 is enumerated from the generated descriptors and
called on the server that hosts it: a stranger (no key) is refused all of them, the API key opens
only the public Scheduler API, the mesh's key opens the rest. A stranger cannot register a
worker; a holder of the key cannot take over a live worker's id. No key shows in any argv or
log. The gateway runs too (as `llmesh up` starts it) and serves with K over the keyed mesh.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import secrets
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import httpx
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.cli import build_parser, up_kwargs
from llmesh.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.grpc_server import PLAINTEXT, ChannelSecurity, open_sync_channel
from services.launcher import (
    LocalMesh,
    child_ready,
    gateway_available,
    start_mesh,
    start_router,
    wait_until,
)
from services.mesh_secret import ENV_KEY, ENV_KEY_FILE
from services.ports import free_port
from tests.integration.conftest import service_logs

PROTOS = pathlib.Path(__file__).resolve().parents[2] / "protos" / "llmesh" / "v1"
API_KEY = "K-" + secrets.token_urlsafe(16)  # random: a hit in argv or a log is this test's key
UP_ARGV = [
    "up",
    "--api-key",
    API_KEY,
    "--scheduler-port",
    "0",
    "--worker-args",
    f"--kv-cache-memory {64 << 20}",
    "--kvstore-args",
    "--memory-bytes 64MiB",
]
PROMPT = "The capital of France is"
TIMEOUT = 20.0
FAKE_TOKEN = 42  # what a hijacker's worker would answer


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[LocalMesh]:
    log_dir = tmp_path_factory.mktemp("zero-trust")
    kwargs = up_kwargs(build_parser().parse_args(UP_ARGV))
    kwargs.pop("port")  # the gateway's (8000 by default): any free one here, as run_up would use it
    # tests/conftest.py gives the session a key; `llmesh up` run by a user has none: make its own.
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENV_KEY, raising=False)
        mp.delenv(ENV_KEY_FILE, raising=False)
        try:
            gateway_port = 0 if gateway_available() else None
            m = start_mesh(**kwargs, gateway_port=gateway_port, log_dir=str(log_dir), timeout=120)
        except Exception as e:
            raise RuntimeError(f"the zero-trust mesh did not start: {e}\n{service_logs(log_dir)}") from e
    m.log_dir = log_dir  # type: ignore[attr-defined]
    # A router in front of the scheduler (as `llmesh up --schedulers N` puts one in front of
    # shards): its own RPCs (ShardRegistry) are internal, its public API takes the API key.
    router = start_router(
        f"127.0.0.1:{free_port('127.0.0.1')}",
        [m.scheduler.address],
        env={**m.scheduler.env, "LLMESH_ROUTER_API_KEY": API_KEY},
        log_dir=str(log_dir),
    )
    m.router = router  # type: ignore[attr-defined]
    try:
        wait_until(lambda: child_ready(router), "router", [router.proc], 60)
        yield m
    finally:
        router.proc.kill()
        router.proc.wait()
        m.stop()


def mesh_key(mesh: LocalMesh) -> ChannelSecurity:
    return ChannelSecurity(key=mesh.internal_key)


API = ChannelSecurity(key=API_KEY)


# -- every RPC of protos/, from the generated descriptors -----------------------------------


def proto_services() -> dict[str, list[MethodDescriptor]]:
    """Every service of every .proto file in protos/llmesh/v1, by full name, with its methods."""
    found: dict[str, list[MethodDescriptor]] = {}
    for proto in sorted(PROTOS.glob("*.proto")):
        module = importlib.import_module(f"llmesh.v1.{proto.stem}_pb2")
        for svc in module.DESCRIPTOR.services_by_name.values():
            found[svc.full_name] = list(svc.methods)
    return found


def hosts(mesh: LocalMesh) -> dict[str, str]:
    """Which process of the mesh serves each service."""
    return {
        "llmesh.v1.Scheduler": mesh.scheduler.address,
        "llmesh.v1.Registry": mesh.scheduler.address,
        "llmesh.v1.SchedulerCore": mesh.scheduler.address,
        "llmesh.v1.Worker": mesh.workers[0].address,
        "llmesh.v1.KVStore": mesh.kvstore.address,
        "llmesh.v1.KVEvents": mesh.scheduler.address,
        "llmesh.v1.ShardRegistry": mesh.router.address,  # type: ignore[attr-defined]
        "llmesh.v1.ShardPicker": mesh.router.address,  # type: ignore[attr-defined]
    }


def call_empty(address: str, method: MethodDescriptor, security: ChannelSecurity) -> grpc.StatusCode:
    """Call `method` with an empty request (a stream: one empty message); the status it ends with."""
    request = message_factory.GetMessageClass(method.input_type)().SerializeToString()
    path = f"/{method.containing_service.full_name}/{method.name}"
    kind = ("stream_" if method.client_streaming else "unary_") + (
        "stream" if method.server_streaming else "unary"
    )
    with open_sync_channel(address, security) as channel:
        rpc = getattr(channel, kind)(path)  # no (de)serializers: raw bytes in and out
        arg = iter([request]) if method.client_streaming else request
        try:
            reply = rpc(arg, timeout=TIMEOUT)
            if method.server_streaming:
                for _ in reply:
                    if not method.client_streaming:  # a feed (KVEvents) never ends: its first
                        reply.cancel()  # message says the call got in
                        return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def every_rpc(mesh: LocalMesh, services: set[str] | None = None) -> list[tuple[str, MethodDescriptor]]:
    targets = hosts(mesh)
    found = proto_services()
    missing = set(found) - set(targets)
    assert not missing, f"services of protos/ this test does not call (give them a target): {missing}"
    return [
        (targets[name], m)
        for name, methods in found.items()
        if services is None or name in services
        for m in methods
    ]


def test_the_enumeration_covers_every_rpc_of_the_protos(mesh: LocalMesh) -> None:
    found = proto_services()
    assert set(found) == {
        "llmesh.v1.Scheduler",
        "llmesh.v1.Registry",
        "llmesh.v1.SchedulerCore",
        "llmesh.v1.Worker",
        "llmesh.v1.KVStore",
        "llmesh.v1.KVEvents",
        "llmesh.v1.ShardRegistry",
        "llmesh.v1.ShardPicker",
    }
    # The .proto text and the descriptors agree on the number of RPCs: nothing is skipped.
    in_text = sum(line.lstrip().startswith("rpc ") for p in PROTOS.glob("*.proto") for line in p.open())
    assert len(every_rpc(mesh)) == sum(map(len, found.values())) == in_text >= 20


def test_llmesh_up_made_a_fresh_mesh_key(mesh: LocalMesh) -> None:
    assert mesh.internal_key and len(mesh.internal_key) >= 32
    assert mesh.internal_key != os.environ.get(ENV_KEY)  # not the test session's, not the local key


def test_a_stranger_is_refused_every_rpc(mesh: LocalMesh) -> None:
    codes = {f"{m.full_name}": call_empty(addr, m, PLAINTEXT) for addr, m in every_rpc(mesh)}
    wrong = {name: code for name, code in codes.items() if code != grpc.StatusCode.UNAUTHENTICATED}
    assert not wrong, f"answered a caller with no credentials: {wrong}"


def test_a_wrong_key_is_refused_every_rpc(mesh: LocalMesh) -> None:
    wrong_key = ChannelSecurity(key=secrets.token_urlsafe(32))
    codes = {m.full_name: call_empty(addr, m, wrong_key) for addr, m in every_rpc(mesh)}
    wrong = {name: code for name, code in codes.items() if code != grpc.StatusCode.UNAUTHENTICATED}
    assert not wrong, f"answered a caller with a wrong key: {wrong}"


def test_health_stays_open(mesh: LocalMesh) -> None:
    for address in sorted(set(hosts(mesh).values())):
        with open_sync_channel(address, PLAINTEXT) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, address


def test_the_api_key_opens_the_public_api_only(mesh: LocalMesh) -> None:
    codes = {m.full_name: call_empty(addr, m, API) for addr, m in every_rpc(mesh)}
    public = {n: c for n, c in codes.items() if n.startswith("llmesh.v1.Scheduler.")}
    internal = {n: c for n, c in codes.items() if not n.startswith("llmesh.v1.Scheduler.")}
    assert public and all(c != grpc.StatusCode.UNAUTHENTICATED for c in public.values()), public
    assert internal and all(c == grpc.StatusCode.UNAUTHENTICATED for c in internal.values()), internal
    with open_sync_channel(mesh.scheduler.address, API) as channel:
        tokens = generation_pb2_grpc.SchedulerStub(channel).Tokenize(
            generation_pb2.TokenizeRequest(text=PROMPT), timeout=TIMEOUT
        )
    assert list(tokens.token_ids)


def test_the_mesh_key_opens_every_rpc(mesh: LocalMesh) -> None:
    # An empty request may be invalid (INVALID_ARGUMENT), or lack the worker's step token
    # (PERMISSION_DENIED): what matters is that the call got past authentication.
    codes = {m.full_name: call_empty(addr, m, mesh_key(mesh)) for addr, m in every_rpc(mesh)}
    refused = {n: c for n, c in codes.items() if c == grpc.StatusCode.UNAUTHENTICATED}
    assert not refused, f"refused the mesh's own key: {refused}"
    assert codes["llmesh.v1.Registry.GetStats"] == grpc.StatusCode.OK
    assert codes["llmesh.v1.KVStore.Stats"] == grpc.StatusCode.OK
    assert codes["llmesh.v1.Worker.GetWorkerInfo"] == grpc.StatusCode.OK


def test_the_gateway_takes_k_and_reaches_the_scheduler_with_the_mesh_key(mesh: LocalMesh) -> None:
    if mesh.gateway is None:
        pytest.skip("no gateway in this checkout")
    with httpx.Client(base_url=f"http://{mesh.gateway.address}/v1", timeout=120) as http:
        assert http.get("/models").status_code == 401
        assert http.get("/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        resp = http.post("/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4


# -- registration: a stranger cannot join, a holder of the key cannot hijack a live id -------


@dataclass
class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """A worker of an attacker's: reports what it is told, answers every plan with FAKE_TOKEN."""

    info: worker_pb2.WorkerInfo
    calls: list[str]

    def GetWorkerInfo(self, request, context):
        self.calls.append("GetWorkerInfo")
        return self.info

    def Ping(self, request, context):
        self.calls.append("Ping")
        return worker_pb2.PingResponse(worker_id=self.info.worker_id, instance_id=self.info.instance_id)

    def Step(self, request_iterator, context):
        self.calls.append("Step")
        for plan in request_iterator:
            seq_ids = [s.seq_id for s in plan.new_seqs] + list(plan.scheduled.seq_ids)
            yield worker_pb2.StepResult(
                step_id=plan.step_id, seq_ids=seq_ids, token_ids=[FAKE_TOKEN] * len(seq_ids)
            )


@pytest.fixture
def fake_worker(mesh: LocalMesh) -> Iterator[tuple[str, FakeWorker]]:
    with open_sync_channel(mesh.workers[0].address, mesh_key(mesh)) as channel:
        real = worker_pb2_grpc.WorkerStub(channel).GetWorkerInfo(
            worker_pb2.GetWorkerInfoRequest(), timeout=10
        )
    info = worker_pb2.WorkerInfo()
    info.CopyFrom(real)  # the same model and fingerprint: only the process differs
    info.instance_id = "fake-" + secrets.token_hex(8)
    fake = FakeWorker(info, [])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", fake
    server.stop(grace=None)


def stats(mesh: LocalMesh) -> worker_pb2.SchedulerStats:
    with open_sync_channel(mesh.scheduler.address, mesh_key(mesh)) as channel:
        return worker_pb2_grpc.RegistryStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=TIMEOUT)


def register(mesh: LocalMesh, security: ChannelSecurity, address: str, worker_id: str):
    request = worker_pb2.RegisterWorkerRequest(address=address, worker_id=worker_id, step_token="t")
    with open_sync_channel(mesh.scheduler.address, security) as channel:
        return worker_pb2_grpc.RegistryStub(channel).RegisterWorker(request, timeout=TIMEOUT)


def greedy(mesh: LocalMesh) -> list[int]:
    req = generation_pb2.GenerateRequest(
        prompt_text=PROMPT, sampling_params=generation_pb2.SamplingParams(temperature=0, max_tokens=8)
    )
    with open_sync_channel(mesh.scheduler.address, API) as channel:
        stream = generation_pb2_grpc.SchedulerStub(channel).Generate(req, timeout=120)
        return [t for resp in stream for t in resp.token_ids]


def workers(mesh: LocalMesh) -> dict[str, str]:
    return {w.worker_id: w.address for w in stats(mesh).workers}


def test_a_stranger_cannot_register_a_worker(mesh: LocalMesh, fake_worker) -> None:
    address, fake = fake_worker
    before = workers(mesh)
    fake.info.worker_id = "intruder"
    for security in (PLAINTEXT, API):
        with pytest.raises(grpc.RpcError) as refused:
            register(mesh, security, address, "intruder")
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert workers(mesh) == before and "intruder" not in before
    assert fake.calls == []  # refused before the scheduler dialled it back


def test_a_holder_of_the_key_cannot_take_over_a_live_worker_id(mesh: LocalMesh, fake_worker) -> None:
    address, fake = fake_worker
    expected = greedy(mesh)
    assert len(expected) == 8 and expected != [FAKE_TOKEN] * 8
    real = workers(mesh)
    assert list(real) == ["worker-0"] and real["worker-0"] == mesh.workers[0].address
    resp = register(mesh, mesh_key(mesh), address, "worker-0")
    assert not resp.accepted and "live" in resp.message, resp.message
    assert workers(mesh) == real
    assert greedy(mesh) == expected
    assert "Step" not in fake.calls


# -- secrets never on a command line --------------------------------------------------------


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # a process that ended, or another user's
        return b""


def test_no_key_in_any_argv(mesh: LocalMesh) -> None:
    keys = (mesh.internal_key.encode(), API_KEY.encode())
    ours = {c.proc.pid for c in mesh.children}
    cmdlines = {
        int(p.name): _read(f"{p}/cmdline") for p in pathlib.Path("/proc").iterdir() if p.name.isdigit()
    }
    assert all(cmdlines.get(pid) for pid in ours), "a child of the mesh is not running"
    leaked = {
        pid: cmd.replace(b"\0", b" ")[:200] for pid, cmd in cmdlines.items() if any(k in cmd for k in keys)
    }
    assert not leaked, f"a key is on a command line (ps shows it): {leaked}"
    # They travel in the children's environment instead (readable by this user only).
    for child in mesh.children:
        env = _read(f"/proc/{child.proc.pid}/environ").split(b"\0")
        assert f"{ENV_KEY}={mesh.internal_key}".encode() in env, child.name
    assert f"LLMESH_SCHEDULER_API_KEY={API_KEY}".encode() in _read(f"/proc/{mesh.scheduler.proc.pid}/environ")


def test_no_key_in_the_logs(mesh: LocalMesh) -> None:
    # After the refusals above: a refused call must not echo what it was sent or what was expected.
    logs = service_logs(mesh.log_dir, tail=1 << 30)  # type: ignore[attr-defined]
    assert logs
    assert mesh.internal_key not in logs and API_KEY not in logs
