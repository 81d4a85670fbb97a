"""The scheduler's core over many workers: routing, one planning loop per worker, failover.

Transport-free: a worker is reached through a `WorkerLink` (the gRPC Step
stream in the service, a model runner in a thread in tests and benchmarks).
Callers get an asyncio queue of `RequestDelta`s per request.

When a worker's link breaks, every request it held is re-routed to the other
workers with prompt + the tokens generated so far, so it is recomputed there
and continues; callers see no error and no duplicated or lost tokens, because
deltas are only ever produced from the planner's own appended tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.planner import Planner, PlannerConfig, RequestRejected
from scheduler_svc.request import Request, RequestDelta
from scheduler_svc.router import route
from services.sampling_params import SamplingParams
from services.step import StepPlan, StepResult, WorkerInfo

log = logging.getLogger(__name__)


class LinkBroken(Exception):
    """The worker is gone (stream broken, process dead, deadline passed)."""


class NoWorkerAvailable(Exception):
    """No live worker can take the request."""


class WorkerLink(Protocol):
    async def step(self, plan: StepPlan) -> StepResult: ...

    async def close(self) -> None: ...


@dataclass
class MeshConfig:
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    enable_prefix_caching: bool = True
    # A worker with this many more queued requests than the least-loaded one loses its prefix advantage.
    overload_margin: int = 8


@dataclass
class WorkerSlot:
    worker_id: str
    info: WorkerInfo
    link: WorkerLink
    planner: Planner
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    num_steps: int = 0
    step_seconds: float = 0.0  # time inside link.step (transport + execution)


@dataclass
class _Stream:
    queue: asyncio.Queue
    worker_id: str


class Mesh:
    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        self.workers: dict[str, WorkerSlot] = {}
        self.streams: dict[str, _Stream] = {}
        self.ready = asyncio.Event()
        self.num_failovers = 0
        # Called with the number of live workers whenever one joins or leaves (health, metrics).
        self.on_workers_changed: list = []

    # ----- workers -----
    def add_worker(self, worker_id: str, info: WorkerInfo, link: WorkerLink) -> WorkerSlot:
        if worker_id in self.workers:
            raise ValueError(f"worker {worker_id!r} is already registered")
        cfg = self.config.planner
        planner_cfg = replace(
            cfg, max_model_len=min(cfg.max_model_len or info.max_model_len, info.max_model_len)
        )
        blocks = BlockManager(
            info.num_kv_blocks, info.block_size, info.fingerprint, self.config.enable_prefix_caching
        )
        slot = WorkerSlot(worker_id, info, link, Planner(planner_cfg, blocks))
        self.workers[worker_id] = slot
        slot.task = asyncio.get_running_loop().create_task(self._run(slot), name=f"worker-loop-{worker_id}")
        self.ready.set()
        self._notify()
        log.info("worker joined", extra={"worker_id": worker_id, "blocks": info.num_kv_blocks})
        return slot

    async def remove_worker(self, worker_id: str, reason: str = "removed") -> None:
        slot = self.workers.pop(worker_id, None)
        if slot is None:
            return
        if not self.workers:
            self.ready.clear()
        self._notify()
        if slot.task is not None and slot.task is not asyncio.current_task():
            slot.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await slot.task
        with contextlib.suppress(Exception):
            await slot.link.close()
        log.warning("worker left", extra={"worker_id": worker_id, "reason": reason})
        self._requeue(slot)

    @property
    def model_info(self) -> WorkerInfo | None:
        return next((s.info for s in self.workers.values()), None)

    # ----- requests -----
    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        queue: asyncio.Queue | None = None,
    ) -> asyncio.Queue:
        """Route and enqueue a request; its deltas go to `queue` (shared by a request's n choices)."""
        if request_id in self.streams:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        info = self.model_info
        if info is None:
            raise NoWorkerAvailable("no worker is registered")
        bad = [t for t in prompt_token_ids if not 0 <= t < info.vocab_size]
        if bad:
            raise RequestRejected(
                f"prompt token ids outside the vocabulary [0, {info.vocab_size}): {bad[:5]}"
            )
        req = Request(request_id, list(prompt_token_ids), params, list(info.eos_token_ids), priority)
        queue = queue if queue is not None else asyncio.Queue()
        self._place(req, queue)
        return queue

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestDelta]:
        """Deltas until the request finishes; leaving early (cancel, error) aborts it."""
        queue = self.submit(request_id, prompt_token_ids, params, priority)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return False
        slot = self.workers.get(stream.worker_id)
        if slot is not None and slot.planner.abort(request_id) is not None:
            slot.wakeup.set()
        return True

    def stats(self) -> dict:
        workers = {}
        for wid, s in self.workers.items():
            b = s.planner.blocks
            workers[wid] = {
                "running": s.planner.num_running,
                "waiting": s.planner.num_waiting,
                "kv_usage": b.usage,
                "free_blocks": b.num_free_blocks,
                "num_blocks": b.num_blocks,
                "prefix_queries": b.stats.queries,
                "prefix_hits": b.stats.hits,
                "requests_hit": b.stats.requests_hit,
                "preemptions": s.planner.num_preemptions,
                "steps": s.num_steps,
                "step_seconds": s.step_seconds,
            }
        return {"workers": workers, "failovers": self.num_failovers, "streams": len(self.streams)}

    # ----- internals -----
    def _notify(self) -> None:
        for callback in self.on_workers_changed:
            callback(len(self.workers))

    def _place(self, req: Request, queue: asyncio.Queue) -> None:
        planners = {wid: s.planner for wid, s in self.workers.items()}
        choice = route(planners, req.all_token_ids, self.config.overload_margin)
        if choice is None:
            raise NoWorkerAvailable("no worker is registered")
        slot = self.workers[choice.worker_id]
        slot.planner.add_request(req)  # may raise RequestRejected
        self.streams[req.request_id] = _Stream(queue, choice.worker_id)
        slot.wakeup.set()

    def _requeue(self, dead: WorkerSlot) -> None:
        """Move every unfinished request of a dead worker to the others, tokens so far kept."""
        for old in list(dead.planner.requests.values()):
            stream = self.streams.pop(old.request_id, None)
            if stream is None:
                continue
            req = Request(
                old.request_id,
                old.prompt_token_ids,
                old.sampling_params,
                old.eos_token_ids,
                old.priority,
                old.arrival_time,
                list(old.output_token_ids),
                list(old.output_logprobs),
            )
            try:
                self._place(req, stream.queue)
                self.num_failovers += 1
            except (NoWorkerAvailable, RequestRejected) as e:
                stream.queue.put_nowait(NoWorkerAvailable(f"worker {dead.worker_id} died and {e}"))

    async def _run(self, slot: WorkerSlot) -> None:
        planner = slot.planner
        try:
            while True:
                if not planner.has_work_for_worker():
                    slot.wakeup.clear()
                    await slot.wakeup.wait()
                    continue
                plan = planner.schedule()
                if plan.num_seqs == 0 and not plan.finished_ids and not plan.preempted_ids:
                    slot.wakeup.clear()
                    await slot.wakeup.wait()
                    continue
                t0 = time.perf_counter()
                result = await slot.link.step(plan)
                slot.step_seconds += time.perf_counter() - t0
                slot.num_steps += 1
                for delta in planner.update(plan, result):
                    self._emit(delta)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken link or a worker-side failure: fail over
            log.error("worker loop failed", extra={"worker_id": slot.worker_id, "error": repr(e)})
            await self.remove_worker(slot.worker_id, reason=repr(e))

    def _emit(self, delta: RequestDelta) -> None:
        stream = self.streams.get(delta.request_id)
        if stream is None:
            return
        if delta.finished:
            del self.streams[delta.request_id]
        stream.queue.put_nowait(delta)
