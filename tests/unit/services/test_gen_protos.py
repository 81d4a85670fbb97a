"""Stub generation: idempotent, stale-aware, and the generated stubs import under this runtime."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import grpc
import pytest

from services import gen_protos


def test_generated_stubs_import() -> None:
    gen_protos.ensure_stubs()
    for name in ("generation_pb2", "generation_pb2_grpc", "worker_pb2", "worker_pb2_grpc"):
        importlib.import_module(f"llmesh.v1.{name}")
    from llmesh.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

    scheduler = generation_pb2.DESCRIPTOR.services_by_name["Scheduler"]
    assert scheduler.full_name == "llmesh.v1.Scheduler"
    assert set(scheduler.methods_by_name) == {
        "Generate",
        "Abort",
        "GetModelInfo",
        "ListModels",
        "Tokenize",
        "Detokenize",
    }
    worker = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    assert set(worker.methods_by_name) == {"GetWorkerInfo", "Step", "Ping"}
    step = worker.methods_by_name["Step"]
    assert step.client_streaming and step.server_streaming
    assert hasattr(generation_pb2_grpc, "SchedulerStub") and hasattr(
        worker_pb2_grpc, "add_WorkerServicer_to_server"
    )


def test_stubs_accept_the_oldest_supported_grpcio() -> None:
    # The GPU machine runs grpcio 1.84: stubs generated here must not demand newer.
    from llmesh.v1 import worker_pb2_grpc

    generated = tuple(int(x) for x in worker_pb2_grpc.GRPC_GENERATED_VERSION.split(".")[:2])
    assert generated <= (1, 84), (
        f"stubs need grpcio>={worker_pb2_grpc.GRPC_GENERATED_VERSION}: pin grpcio-tools"
    )
    assert tuple(int(x) for x in grpc.__version__.split(".")[:2]) >= generated


def test_generation_is_idempotent_and_notices_changes(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="generation needs grpcio-tools (a test/build dependency)")
    protos = tmp_path / "protos"
    shutil.copytree(gen_protos.PROTO_ROOT, protos)
    out = tmp_path / "out"
    written = gen_protos.generate(proto_root=protos, out_root=out)
    names = {p.relative_to(out).as_posix() for p in written}
    assert {
        "llmesh/v1/__init__.py",
        "llmesh/v1/generation_pb2.py",
        "llmesh/v1/generation_pb2.pyi",
        "llmesh/v1/generation_pb2_grpc.py",
        "llmesh/v1/worker_pb2.py",
        "llmesh/v1/worker_pb2_grpc.py",
    } <= names
    assert gen_protos.is_up_to_date(protos, out)
    assert gen_protos.generate(proto_root=protos, out_root=out) == []  # up to date: nothing rewritten

    worker = protos / "llmesh" / "v1" / "worker.proto"
    worker.write_text(worker.read_text() + "\nmessage Extra {}\n")
    assert not gen_protos.is_up_to_date(protos, out)
    assert gen_protos.generate(proto_root=protos, out_root=out)
    assert "Extra" in (out / "llmesh" / "v1" / "worker_pb2.pyi").read_text()

    (out / "llmesh" / "v1" / "worker_pb2_grpc.py").unlink()  # a missing output is stale too
    assert not gen_protos.is_up_to_date(protos, out)


def test_check_flag(capsys) -> None:
    gen_protos.ensure_stubs()
    assert gen_protos.main(["--check"]) == 0
    assert "up to date" in capsys.readouterr().out
