"""The in-process engine: one planner + one model runner, no sockets.

The services compose the same two classes over gRPC; this composition backs the
offline API and the throughput benchmarks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.planner import Planner, PlannerConfig
from scheduler_svc.request import FinishReason, Request, RequestDelta
from services.sampling_params import SamplingParams
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner


@dataclass
class EngineConfig:
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    enable_prefix_caching: bool = True

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Split flat keyword settings (as `LLM(...)` takes them) between the two configs."""
        worker_fields = {f.name for f in dataclasses.fields(WorkerConfig)}
        planner_fields = {f.name for f in dataclasses.fields(PlannerConfig)}
        enable = kwargs.pop("enable_prefix_caching", True)
        unknown = set(kwargs) - worker_fields - planner_fields
        if unknown:
            raise TypeError(f"unknown engine settings: {', '.join(sorted(unknown))}")
        worker = WorkerConfig(**{k: v for k, v in kwargs.items() if k in worker_fields})
        planner_kw = {k: v for k, v in kwargs.items() if k in planner_fields}
        planner_kw.setdefault("max_model_len", 0)
        return cls(worker=worker, planner=PlannerConfig(**planner_kw), enable_prefix_caching=enable)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config.worker)
        info = self.runner.info
        self.info = info
        planner_cfg = dataclasses.replace(
            config.planner,
            max_model_len=min(config.planner.max_model_len or info.max_model_len, info.max_model_len),
        )
        self.blocks = BlockManager(
            info.num_kv_blocks, info.block_size, info.fingerprint, config.enable_prefix_caching
        )
        self.planner = Planner(planner_cfg, self.blocks)
        self.num_steps = 0

    @property
    def max_model_len(self) -> int:
        return self.planner.config.max_model_len

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        vocab = self.info.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        self.planner.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=params,
                eos_token_ids=self.info.eos_token_ids,
                priority=priority,
            )
        )

    def abort(self, request_id: str) -> RequestDelta | None:
        req = self.planner.abort(request_id)
        return self.planner.delta(req, 0) if req is not None else None

    def finish(self, request_id: str, reason: FinishReason) -> None:
        """End a request from outside (a stop string matched): abort, then relabel."""
        req = self.planner.abort(request_id)
        if req is not None:
            req.finish_reason = reason

    def has_unfinished(self) -> bool:
        return self.planner.has_unfinished()

    def step(self) -> list[RequestDelta]:
        plan = self.planner.schedule()
        if plan.num_seqs == 0 and not plan.finished_ids and not plan.preempted_ids:
            return []
        result = self.runner.execute(plan)
        self.num_steps += 1
        return self.planner.update(plan, result)
