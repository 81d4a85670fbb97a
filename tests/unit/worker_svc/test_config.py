"""Batch limits left unset follow vLLM's defaults for the device (the CPU keeps small ones)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scheduler_svc.mesh import Mesh, MeshConfig
from scheduler_svc.planner import PlannerConfig
from services.step import WorkerInfo
from worker_svc.config import WorkerConfig, default_batch_limits


def test_the_cpu_keeps_small_batches():
    assert default_batch_limits(torch.device("cpu")) == (64, 2048)
    assert WorkerConfig(device="cpu").resolved_max_num_seqs() == 64
    assert WorkerConfig(device="cpu", max_num_seqs=8).resolved_max_num_seqs() == 8


@pytest.mark.parametrize(
    ("name", "gib", "served", "offline"),
    [
        ("NVIDIA H100 80GB HBM3", 80, (1024, 8192), (1024, 16384)),
        ("NVIDIA H200", 141, (1024, 8192), (1024, 16384)),
        ("NVIDIA A100-SXM4-80GB", 80, (256, 2048), (256, 8192)),  # big budgets measured slower there
        ("NVIDIA L4", 24, (256, 2048), (256, 8192)),
    ],
)
def test_gpus_get_vllms_defaults(monkeypatch, name, gib, served, offline):
    # No GPU here: the device's name and memory are what the choice reads.
    props = SimpleNamespace(name=name, total_memory=gib * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert default_batch_limits(torch.device("cuda", 0)) == served
    assert default_batch_limits(torch.device("cuda", 0), offline=True) == offline


async def test_a_scheduler_without_limits_plans_with_the_workers():
    info = WorkerInfo("m", b"fp", 16, 100, 512, 100, [2], max_num_seqs=1024, max_num_batched_tokens=8192)
    mesh = Mesh(MeshConfig())
    slot = mesh.add_worker("w", info, link=SimpleNamespace())  # type: ignore[arg-type]
    slot.task.cancel()
    assert (slot.planner.config.max_num_seqs, slot.planner.config.max_num_batched_tokens) == (1024, 8192)
    mesh = Mesh(MeshConfig(planner=PlannerConfig(max_num_seqs=32)))
    slot = mesh.add_worker("w", info, link=SimpleNamespace())  # type: ignore[arg-type]
    slot.task.cancel()
    assert (slot.planner.config.max_num_seqs, slot.planner.config.max_num_batched_tokens) == (32, 8192)
