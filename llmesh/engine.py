"""The in-process engine: the scheduler's `Mesh` over one model runner, no sockets.

The services compose the same two parts over gRPC (scheduler_svc's Mesh, a
worker's ModelRunner behind the Step stream); here the runner sits behind a
`LocalWorkerLink`, so asynchronous scheduling, failover rules and everything
the Mesh learns are written once. The Mesh runs on an event loop in a
background thread of this engine, so that callers (the offline `LLM`, a
notebook with its own loop) need no asyncio; `submit`-style calls cross into
that loop thread-safely.

`add_request()` + `step()` are kept for tests and micro-benchmarks that drive
single steps synchronously; they must not be mixed with `submit()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from llmesh.kv_store import ThreadedLookup, open_kv_store
from llmesh.local_link import LocalWorkerLink
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.mesh import Mesh, MeshConfig
from scheduler_svc.planner import Planner, PlannerConfig
from scheduler_svc.request import Request, RequestDelta
from services.config import from_flat
from services.sampling_params import SamplingParams
from worker_svc.config import WorkerConfig, default_batch_limits
from worker_svc.pipeline import StepPipeline
from worker_svc.runner import ModelRunner, shorten_gil_switch_interval

T = TypeVar("T")

LOCAL_WORKER = "local"
OFFLINE_STREAM_INTERVAL = 16


# Where the offline engine's scheduler core differs from a served one's (MeshConfig's defaults).
OFFLINE_MESH_DEFAULTS: dict[str, Any] = {
    # Nothing streams offline: fewer, larger deltas keep the per-token Python of 500 requests
    # off the GIL the runner needs between steps (vLLM's offline API hands out final outputs
    # only). A stop string may then be seen up to this many tokens late; the text is the same.
    "stream_interval": OFFLINE_STREAM_INTERVAL,
    # The offline API queues every prompt it is given: no admission control.
    "max_waiting_requests": 0,
}


def offline_mesh_config() -> MeshConfig:
    return MeshConfig(**OFFLINE_MESH_DEFAULTS)


@dataclass
class EngineConfig:
    """The worker's config and the scheduler core's (`MeshConfig`, its planner's within), composed
    as the services compose them: one declaration per knob, the offline defaults above."""

    worker: WorkerConfig = field(default_factory=WorkerConfig)
    mesh: MeshConfig = field(default_factory=offline_mesh_config)
    # The KV store prefixes are put to and loaded from (llmesh.kv_store.open_kv_store); None = none.
    kv_store: Any = None

    @property
    def planner(self) -> PlannerConfig:
        return self.mesh.planner

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """From flat keyword settings (as `LLM(...)` takes them): each goes to the config that
        declares it (services.config.from_flat walks `worker` and `mesh` by their fields, no
        list of names here); a name both declare (max_num_seqs, max_model_len) reaches both."""
        return from_flat(cls, {**OFFLINE_MESH_DEFAULTS, **kwargs}, what="engine settings")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        shorten_gil_switch_interval()  # the runner steps on a thread of its own (LocalWorkerLink)
        self.kv_store = (
            open_kv_store(
                config.kv_store,
                shared_memory=config.worker.kv_store_shared_memory,
                segment_bytes=config.worker.kv_store_segment_bytes,
                transfer=config.worker.kv_store_transfer,
            )
            if config.kv_store is not None
            else None
        )
        self.runner = ModelRunner(config.worker, kv_store=self.kv_store)
        info = self.runner.info
        self.info = info
        # Limits left unset: the runner's batch, and vLLM's offline token budget for the device.
        offline_tokens = default_batch_limits(self.runner.device, offline=True)[1]
        planner_cfg = dataclasses.replace(
            config.planner.for_worker(info.max_num_seqs, offline_tokens),
            max_model_len=min(config.planner.max_model_len or info.max_model_len, info.max_model_len),
        )
        self.mesh = Mesh(
            dataclasses.replace(config.mesh, planner=planner_cfg),
            kv_store=ThreadedLookup(self.kv_store) if self.kv_store is not None else None,
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="llmesh-engine", daemon=True)
        self._thread.start()
        # Plans are launched one ahead of reading the previous one's sampled ids (StepPipeline).
        self._link = link = LocalWorkerLink(StepPipeline(self.runner), info, self.runner.drop_all)
        # `close()`, or garbage collection, or exit: the same shutdown, once. It holds what it stops,
        # never the engine, so that `del llm` collects the engine and frees its GPU memory at once.
        owned_store = self.kv_store if isinstance(config.kv_store, str) else None
        self._shutdown = weakref.finalize(
            self, _shutdown, self.mesh, self._loop, self._thread, link, self.runner, owned_store
        )
        self._slot = self.call(lambda: self.mesh.add_worker(LOCAL_WORKER, info, link))
        self._num_sync_steps = 0

    # ----- the loop thread -----
    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine's loop thread and return its result (Mesh state lives there)."""

        async def run() -> T:
            return fn()

        return self.wait(run())

    def wait(self, coro: Awaitable[T]) -> T:
        if not self._shutdown.alive:
            if asyncio.iscoroutine(coro):
                coro.close()  # never awaited: no "coroutine was never awaited" warning
            raise RuntimeError("this engine is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    # ----- state -----
    @property
    def planner(self) -> Planner:
        return self._slot.planner

    @property
    def blocks(self) -> BlockManager:
        return self._slot.planner.blocks

    @property
    def num_steps(self) -> int:
        return self._slot.num_steps + self._num_sync_steps

    @property
    def max_model_len(self) -> int:
        return self.planner.config.max_model_len

    def has_unfinished(self) -> bool:
        return self.planner.has_unfinished()

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        vocab = self.info.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    # ----- synchronous stepping (tests, micro-benchmarks) -----
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str = "",
    ) -> None:
        """Queue a request for `step()` (not for `submit()`: the Mesh streams those).

        `cache_salt`: its prefix-cache salt (vLLM's): it shares cached blocks only with its salt.
        """
        self.check_prompt(prompt_token_ids)
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            self.info.eos_token_ids,
            priority,
            cache_salt=cache_salt,
        )
        self.call(lambda: self.planner.add_request(req))

    def step(self) -> list[RequestDelta]:
        """One synchronous step: plan, execute on this thread, apply. Not with submit()ted requests."""
        plan = self.call(self.planner.schedule)
        if plan.num_seqs == 0 and not plan.finished_ids and not plan.preempted_ids:
            return []
        result = self.runner.execute(plan)
        self._num_sync_steps += 1
        return self.call(lambda: self.planner.update(plan, result))

    # ----- streaming through the Mesh -----
    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue,
        priority: int = 0,
        group: str = "",
        cache_salt: str = "",
        lora_name: str = "",
        lora_path: str = "",
    ) -> None:
        """On the loop thread: route a request into the Mesh; its deltas go to `queue`."""
        self.mesh.submit(
            request_id, prompt_token_ids, params, priority, queue, group=group, cache_salt=cache_salt,
            lora_name=lora_name, lora_path=lora_path,
        )  # fmt: skip

    def flush_kv(self, timeout_s: float = 30.0) -> None:
        """Wait until every KV save and store put planned so far has run and been sent.

        Puts are planned one step after the blocks fill and sent by a background thread, so a
        finished `generate` may still have some going: call this before another engine (or a
        process exit) relies on them.
        """
        deadline = time.monotonic() + timeout_s
        while not self.call(lambda: self._slot.settled) and time.monotonic() < deadline:
            time.sleep(0.002)
        self.runner.kv_tiers.flush(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop the engine's threads and free its device memory (idempotent); unusable after."""
        self._shutdown()

    @property
    def closed(self) -> bool:
        return not self._shutdown.alive

    def check_open(self) -> None:
        if not self._shutdown.alive:
            raise RuntimeError("this engine is closed")
        if self.runner.is_sleeping:
            raise RuntimeError("this engine is asleep: call wake_up() first")

    # ----- sleep (vLLM's LLM.sleep / wake_up) -----
    def sleep(self, level: int = 1) -> None:
        """Offload (level 1) or discard (level 2) the weights and discard the KV cache, between
        steps; the prefix cache is forgotten with it. Only with no request running."""
        if not self._shutdown.alive:
            raise RuntimeError("this engine is closed")
        if self.call(self.has_unfinished):
            raise RuntimeError("sleep() with requests still running")
        self.wait(self._link.run_between_steps(lambda: self.runner.sleep(level)))
        self.call(self.blocks.reset_prefix_cache)  # their contents went with the KV cache

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `sleep` put away: "weights", "kv_cache" or (None) both."""
        if not self._shutdown.alive:
            raise RuntimeError("this engine is closed")
        self.wait(self._link.run_between_steps(lambda: self.runner.wake_up(tags)))


def _shutdown(
    mesh: Mesh,
    loop: asyncio.AbstractEventLoop,
    thread: threading.Thread,
    link: LocalWorkerLink,
    runner: ModelRunner,
    owned_store: Any,
) -> None:
    """Detach the worker (its step thread stops after the step in flight), stop the loop, wait
    for the step thread, then free the runner's device memory. From a thread of the engine's
    own (a collection that happened to run there) it only stops them: freeing under a step
    that is still running is not safe, and the memory goes once their references drop."""
    if loop.is_running() and threading.current_thread() is not thread:
        with contextlib.suppress(Exception):  # a broken mesh must not keep the memory
            coro = mesh.remove_worker(LOCAL_WORKER, reason="engine closed")
            asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=30)
    _stop_loop(loop, thread)
    stopped = link.stop(timeout_s=30)
    runner.close()  # the other tensor-parallel ranks, if any
    if not stopped:
        return  # the step thread still runs (or this is it): freeing under a step is not safe
    runner.release()  # the worker's threads, every device tensor
    if owned_store is not None:
        owned_store.close()  # opened here: its shared memory segments go with it


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Cancel the loop's tasks, stop it, wait for its thread and close it."""

    async def cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        loop.stop()

    if loop.is_running():
        asyncio.run_coroutine_threadsafe(cancel_all(), loop)
    if thread is not threading.current_thread():
        thread.join(timeout=10)
        if not thread.is_alive() and not loop.is_closed():
            loop.close()
