"""Prompt outputs through the planner and the scheduler core's Serve stream: prompt logprobs
(chunks of a chunked prefill filed by position, sent whole, once, with the first token) and
pooling (the vector ends the request, no token, its blocks freed)."""

from __future__ import annotations

import asyncio

import grpc

from llmesh.v1 import core_pb2_grpc
from scheduler_svc.core_client import CoreClient
from scheduler_svc.core_servicer import SchedulerCoreServicer
from scheduler_svc.mesh import Mesh
from services.grpc_server import PLAINTEXT
from services.sampling_params import SamplingParams
from services.step import PooledOutput, PromptLogprobs, StepPlan, StepResult, TokenLogprobs
from tests.unit.scheduler_svc.test_mesh import INFO, local, mesh_config
from tests.unit.scheduler_svc.test_planner import CountingWorker


class PromptLogprobsWorker(CountingWorker):
    """Answers each prompt position p >= 1 it computes with logprob -p (as a real worker's rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.wants: dict[str, int | None] = {}
        self.prompt_lens: dict[str, int] = {}
        self.chunks = 0

    def execute(self, plan: StepPlan) -> StepResult:
        for s in plan.new_seqs:
            self.wants[s.seq_id] = s.sampling_params.prompt_logprobs
            self.prompt_lens[s.seq_id] = s.num_prompt_tokens
        before = {sid: st["done"] for sid, st in self.seqs.items()}
        before.update({s.seq_id: s.num_computed_tokens for s in plan.new_seqs})
        res = super().execute(plan)
        for s in plan.new_seqs + plan.scheduled:
            sid = s.seq_id
            if self.wants.get(sid) is None:
                continue
            tokens = self.seqs[sid]["tokens"]
            start, end = before[sid], min(before[sid] + s.num_new_tokens, self.prompt_lens[sid] - 1)
            entries = [TokenLogprobs(tokens[p], -float(p), 1) for p in range(start + 1, end + 1)]
            self.chunks += bool(entries)
            if entries:
                res.prompt_logprobs.append(PromptLogprobs(sid, start + 1, entries))
        return res


async def test_prompt_logprobs_through_the_core_stream():
    config = mesh_config()
    config.planner.max_num_batched_tokens = 8  # a prompt of 20 tokens in chunks
    mesh = Mesh(config)
    worker = PromptLogprobsWorker()
    mesh.add_worker("w", INFO, local(worker))
    server = grpc.aio.server()
    core_pb2_grpc.add_SchedulerCoreServicer_to_server(SchedulerCoreServicer(mesh), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = CoreClient(f"127.0.0.1:{port}", PLAINTEXT)
    task = asyncio.ensure_future(client.run())
    try:
        await asyncio.wait_for(client.attached.wait(), 10)
        prompt = list(range(10, 30))
        queue = client.submit("r", prompt, SamplingParams(max_tokens=3, prompt_logprobs=0))
        carried = []
        while True:
            d = await queue.get()
            assert not isinstance(d, Exception)
            if d.prompt_logprobs is not None:
                carried.append((d.new_token_ids, d.prompt_logprobs))
            if d.finished:
                break
        assert len(carried) == 1 and carried[0][0]  # once, with the first token
        entries = carried[0][1]
        assert entries[0] is None and worker.chunks >= 3
        assert [(e.token_id, e.logprob) for e in entries[1:]] == [
            (prompt[p], -float(p)) for p in range(1, 20)
        ]
    finally:
        task.cancel()
        await server.stop(0)
        await mesh.remove_worker("w")


class PoolingWorker(CountingWorker):
    """Pools instead of sampling for pooling sequences: the vector is [sum of its tokens, length]."""

    def execute(self, plan: StepPlan) -> StepResult:
        pooling = {s.seq_id for s in plan.new_seqs if s.sampling_params.pooling is not None}
        self.pooling = getattr(self, "pooling", set()) | pooling
        res = super().execute(plan)
        keep = [i for i, sid in enumerate(res.seq_ids) if sid not in self.pooling]
        for sid in res.seq_ids:
            if sid in self.pooling:
                tokens = self.seqs[sid]["tokens"][:-1]  # without the token CountingWorker appended
                res.pooled.append(PooledOutput(sid, [float(sum(tokens)), float(len(tokens))]))
        res.seq_ids = [res.seq_ids[i] for i in keep]
        res.token_ids = [res.token_ids[i] for i in keep]
        res.logprobs = [res.logprobs[i] for i in keep]
        return res


async def test_pooling_through_the_core_stream_frees_its_blocks():
    config = mesh_config()
    config.planner.max_num_batched_tokens = 8  # chunks of the prompt; one step pools it
    mesh = Mesh(config)
    mesh.add_worker("w", INFO, local(PoolingWorker()))
    server = grpc.aio.server()
    core_pb2_grpc.add_SchedulerCoreServicer_to_server(SchedulerCoreServicer(mesh), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = CoreClient(f"127.0.0.1:{port}", PLAINTEXT)
    task = asyncio.ensure_future(client.run())
    try:
        await asyncio.wait_for(client.attached.wait(), 10)
        prompt = list(range(10, 30))
        queue = client.submit("p", prompt, SamplingParams(pooling="mean", max_tokens=None))
        gen = client.submit("g", prompt, SamplingParams(max_tokens=3))  # generation beside it
        d = await queue.get()
        assert not isinstance(d, Exception)
        assert d.finished and not d.new_token_ids and d.embedding == [float(sum(prompt)), 20.0]
        tokens = []
        while True:
            g = await gen.get()
            tokens.extend(g.new_token_ids)
            if g.finished:
                break
        assert len(tokens) == 3
        await asyncio.sleep(0.1)
        planner = mesh.workers["w"].planner
        assert not planner.requests and planner.blocks.num_free_blocks == planner.blocks.num_blocks
    finally:
        task.cancel()
        await server.stop(0)
        await mesh.remove_worker("w")
