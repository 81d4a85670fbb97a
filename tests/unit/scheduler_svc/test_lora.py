"""The scheduler's side of multi-LoRA: a worker never runs more distinct adapters than its slots,
the router prefers a worker that ran the adapter, and adapters root their own key chains."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from llmesh.v1 import core_pb2_grpc
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.core_client import CoreClient
from scheduler_svc.core_servicer import SchedulerCoreServicer
from scheduler_svc.lora import LoRAChecks, LoRAMirror
from scheduler_svc.mesh import Mesh
from scheduler_svc.planner import Planner, PlannerConfig, RequestRejected
from scheduler_svc.request import Request
from scheduler_svc.router import route
from services.grpc_server import PLAINTEXT
from services.sampling_params import SamplingParams
from tests.unit.scheduler_svc.test_mesh import INFO, local, mesh_config
from tests.unit.scheduler_svc.test_planner import CountingWorker


def _planner(max_loras: int) -> Planner:
    p = Planner(PlannerConfig(max_model_len=512), BlockManager(200, 8, b"t"))
    p.loras = LoRAMirror(max_loras)
    return p


def _req(rid: str, lora: str = "", prompt: list[int] | None = None) -> Request:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(
        rid, prompt or [5, 6, 7, 8, 9], params, lora_name=lora, lora_path=f"/a/{lora}" if lora else ""
    )


def test_a_request_of_one_adapter_too_many_waits_and_others_go_past_it() -> None:
    p = _planner(max_loras=2)
    for r in [_req("a1", "a"), _req("b1", "b"), _req("c1", "c"), _req("base"), _req("a2", "a")]:
        p.add_request(r)
    plan = p.schedule()
    admitted = [s.seq_id for s in plan.new_seqs]
    assert admitted == ["a1", "b1", "base", "a2"]  # c waits: a and b hold both slots
    assert {(s.lora_name, s.lora_path) for s in plan.new_seqs} == {("a", "/a/a"), ("b", "/a/b"), ("", "")}
    assert [r.request_id for r in p.waiting] == ["c1"]


def test_the_router_prefers_a_worker_that_ran_the_adapter() -> None:
    holder, other, plain = _planner(2), _planner(2), _planner(0)
    holder.loras.touch(_req("x", "a"))
    planners = {"other": other, "holder": holder, "plain": plain}
    req = _req("r", "a")
    assert route(planners, req.all_token_ids, 4, req.cache_root, ("a", "/a/a")).worker_id == "holder"
    # A worker serving no LoRA is never a candidate for an adapter's request.
    assert route({"plain": plain}, req.all_token_ids, 4, req.cache_root, ("a", "/a/a")) is None


def test_mirror_forgets_the_least_recently_sent_adapter() -> None:
    m = LoRAMirror(2)
    for name in ("a", "b", "a", "c"):
        m.touch(_req("x", name))
    assert m.holds(("a", "/a/a")) and m.holds(("c", "/a/c")) and not m.holds(("b", "/a/b"))


def test_adapters_root_their_own_key_chains() -> None:
    roots = {_req("x").cache_root, _req("x", "a").cache_root, _req("x", "b").cache_root}
    other_folder = Request("x", [5], SamplingParams(), lora_name="a", lora_path="/elsewhere").cache_root
    assert len(roots | {other_folder}) == 4


def test_adapter_checks(tmp_path) -> None:
    checks = LoRAChecks()
    checks.check("", "")
    for name, path in [("a", ""), ("", "/x"), ("bad name", "/x"), ("a", str(tmp_path)), ("a", "/not/here")]:
        with pytest.raises(ValueError, match="^lora_name: "):
            checks.check(name, path)
    from tests.helpers.lora_adapters import make_peft_adapter
    from tests.helpers.tiny_models import make_tiny_model

    adapter = make_peft_adapter(
        tmp_path / "a", make_tiny_model(tmp_path / "m", "llama"), r=8, targets=["q_proj"]
    )
    checks.check("a", adapter, max_rank=8)
    with pytest.raises(ValueError, match="rank 8, above the workers' max_lora_rank 4"):
        checks.check("a", adapter, max_rank=4)  # remembered as servable, the rank still checked


def test_the_router_in_front_of_shards_keys_an_adapter_as_the_scheduler_does() -> None:
    """router_svc hashes prompts for its global prefix index: with the adapter's root, or an
    adapter's request would count the base model's blocks as hits."""
    from router_svc.core import Router, RouterConfigView
    from services.prefix_hash import extend_block_keys, short_key

    r = Router(RouterConfigView(policy="index"))  # type: ignore[arg-type]
    req = _req("x", "a", prompt=list(range(3, 35)))
    # The chain the scheduler's cache is keyed by.
    want = [short_key(k) for k in extend_block_keys([], req.all_token_ids, 8, b"fp", req.cache_root)]
    assert r.prompt_keys(req.all_token_ids, "", 8, b"fp", ("a", "/a/a")) == want
    assert r.prompt_keys(req.all_token_ids, "", 8, b"fp") != want


class _RecordingWorker(CountingWorker):
    def __init__(self) -> None:
        super().__init__()
        self.new: list = []

    def execute(self, plan):  # type: ignore[no-untyped-def]
        self.new += plan.new_seqs
        return super().execute(plan)


@pytest.mark.parametrize("max_loras", [2, 0])
async def test_the_adapter_reaches_the_worker_through_the_core_stream(max_loras: int) -> None:
    """An API process's CoreClient -> the core's Serve stream -> the mesh -> NewSequence."""
    mesh = Mesh(mesh_config())
    worker = _RecordingWorker()
    mesh.add_worker("w", dataclasses.replace(INFO, max_loras=max_loras), local(worker))
    server = grpc.aio.server()
    core_pb2_grpc.add_SchedulerCoreServicer_to_server(SchedulerCoreServicer(mesh), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = CoreClient(f"127.0.0.1:{port}", PLAINTEXT)
    task = asyncio.ensure_future(client.run())
    try:
        await asyncio.wait_for(client.attached.wait(), 10)
        queue = client.submit("l", [5, 6, 7], SamplingParams(max_tokens=3), lora_name="a", lora_path="/a")
        while not isinstance(item := await queue.get(), Exception) and not item.finished:
            pass
        if max_loras:
            assert not isinstance(item, Exception)
            assert [(s.lora_name, s.lora_path) for s in worker.new] == [("a", "/a")]
        else:  # no worker serves LoRA: refused before it runs
            assert isinstance(item, RequestRejected) and "LoRA" in str(item)
            assert worker.new == []
    finally:
        task.cancel()
        await server.stop(0)
        await mesh.remove_worker("w")
