"""The offline API: `LLM(model=None, **config).generate(prompts, SamplingParams)`."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from llmesh.engine import EngineConfig, LLMEngine
from llmesh.frozen_heap import frozen_heap
from llmesh.logprobs import PositionLogprobs, as_position_dicts
from llmesh.lora import LoRARequest, lora_requests_for
from llmesh.pooling import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
)
from scheduler_svc.prefix_hash import check_salt
from scheduler_svc.request import RequestDelta
from services.choices import ChoiceState, FanOut, fit_max_tokens
from services.embeddings import check_dimensions, finish_embedding
from services.model_files import load_tokenizer
from services.sampling_params import SamplingParams
from services.step import TokenLogprobs

Prompt = str | list[int] | dict[str, Any]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs | None] | None = None
    stop_reason: str | int | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        if not self.logprobs:
            return None
        return sum(lp.logprob for lp in self.logprobs if lp is not None)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False
    # vLLM's: with SamplingParams.prompt_logprobs, None for the first prompt token, then per
    # position {token id: Logprob} holding the prompt token and its top-k alternatives.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    _prompt_entries: list | None = field(default=None, repr=False)  # as the engine gave them
    _embedding: list[float] | None = field(default=None, repr=False)  # a pooling request's vector


@dataclass
class _Child:
    """One of a request's n samples while it runs."""

    parent: RequestOutput
    output: CompletionOutput
    state: ChoiceState  # text, stop strings, finish and stop reasons (services/choices.py)


@dataclass
class _Submission:
    fanout: FanOut  # the request's n children, planned and valid before anything is submitted
    prompt_token_ids: list[int]
    priority: int
    group: str
    cache_salt: str = ""  # the prompt's prefix-cache salt ({"cache_salt": ...}, vLLM's)
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)


class LLM:
    """Offline batch generation over the in-process engine (planner + model runner)."""

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **config))
        self.tokenizer = load_tokenizer(self.engine.runner.model_path)
        self._ids = itertools.count()

    # ----- public API -----
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: the LoRA adapter to run with (vLLM's), one for all prompts or one each."""
        self.engine.check_open()
        batch = self._as_batch(prompts)
        params = self._params_for(batch, sampling_params)
        info = self.engine.info
        loras = lora_requests_for(len(batch), lora_request, info.max_loras, info.max_lora_rank)
        children: dict[str, _Child] = {}
        outputs: list[RequestOutput] = []
        submissions: list[_Submission] = []
        # Every prompt and every child is checked before anything is submitted.
        for i, (prompt, sp) in enumerate(zip(batch, params, strict=True)):
            text, token_ids = self._tokenize(prompt)
            self.engine.check_prompt(token_ids)
            # A prompt that fills the context is refused; max_tokens beyond it ends with "length".
            fit_max_tokens(len(token_ids), sp.max_tokens, self.engine.max_model_len, cap=True)
            out = RequestOutput(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=token_ids)
            outputs.append(out)
            # Children of a seeded request get distinct, reproducible seeds (vLLM convention).
            fanout = FanOut.plan(out.request_id, sp)
            prio = priority[i] if priority else 0
            salt = self._salt_of(prompt)
            submissions.append(_Submission(fanout, token_ids, prio, out.request_id, salt, loras[i]))
            for j, cid in enumerate(fanout.ids):
                # Nothing streams here: text is decoded once, after the run, unless stop strings
                # must be matched as tokens arrive (incrementally, on the engine's loop).
                state = ChoiceState(
                    self.tokenizer if sp.detokenize else None,
                    stop=sp.stop,
                    stop_token_ids=sp.stop_token_ids,
                    stream_text=False,
                    keep_token_ids=True,
                )
                comp = CompletionOutput(j, "", state.token_ids, None, [] if sp.logprobs is not None else None)
                out.outputs.append(comp)
                children[cid] = _Child(out, comp, state)
        # No full collection walks the long-lived heap while the run's threads step (frozen_heap).
        with frozen_heap():
            future = asyncio.run_coroutine_threadsafe(
                self._run(children, submissions, len(outputs), use_tqdm), self.engine.loop
            )
            try:
                future.result()
            except BaseException:
                future.cancel()  # the coroutine's cleanup aborts every child still running
                raise
        for child in children.values():  # here, not on the engine's loop: the run is over
            child.output.text = child.state.text
        for out, sp in zip(outputs, params, strict=True):
            if out._prompt_entries is not None:
                tokenizer = self.tokenizer if sp.detokenize else None
                out.prompt_logprobs = as_position_dicts(out._prompt_entries, tokenizer)
                out._prompt_entries = None
        return outputs

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `encode`: each prompt's pooled final hidden states (raw, not normalized)."""
        pp = pooling_params or PoolingParams()
        outs = self.generate(prompts, pp.sampling_params(), use_tqdm)
        return [
            PoolingRequestOutput(o.request_id, o.prompt_token_ids, PoolingOutput(self._vector(o)))
            for o in outs
        ]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's `embed`: each prompt's embedding, cut to `dimensions`, normalized unless
        `normalize=False` (the model's pooling unless `pooling_type` says otherwise)."""
        pp = pooling_params or PoolingParams()
        try:
            check_dimensions(pp.dimensions, self.engine.runner.model_config.hidden_size)
        except ValueError as e:
            raise ValueError(f"dimensions: {e}") from None
        outs = self.generate(prompts, pp.sampling_params(), use_tqdm)
        normalize = pp.normalize is not False
        return [
            EmbeddingRequestOutput(
                o.request_id,
                o.prompt_token_ids,
                EmbeddingOutput(finish_embedding(self._vector(o), pp.dimensions, normalize)),
                prompt=o.prompt,
            )
            for o in outs
        ]

    @staticmethod
    def _vector(out: RequestOutput) -> list[float]:
        if out._embedding is None:
            reason = out.outputs[0].finish_reason if out.outputs else None
            raise RuntimeError(f"request {out.request_id} ended ({reason}) without its pooled vector")
        return out._embedding

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            {
                "prompt_token_ids": self.tokenizer.apply_chat_template(
                    conv, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    # ----- lifetime -----
    def close(self) -> None:
        """Stop the engine's threads and free all of its device memory (weights, KV cache, CUDA
        graphs); idempotent. `with LLM(...) as llm:` closes on leaving, `del llm` as well."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sleep(self, level: int = 1) -> None:
        """vLLM's: free the GPU memory between generations (RL loops). Level 1 offloads the
        weights to host memory and discards the KV cache; level 2 discards both (`wake_up`
        reloads the weights from the checkpoint). Only while no request runs."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: bring back what `sleep` freed, "weights" and/or "kv_cache" (None: both);
        generation resumes once both are back."""
        self.engine.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.engine.runner.is_sleeping

    # ----- internals -----
    async def _run(
        self,
        children: dict[str, _Child],
        submissions: list[_Submission],
        num_requests: int,
        use_tqdm: bool,
    ) -> None:
        """On the engine's loop: submit every child, fold the deltas in as steps produce them.

        Runs while the model runner steps on its own thread, so that folding tokens in (and
        matching stop strings) overlaps the next step instead of sitting between two.
        """
        bar = tqdm(total=num_requests, desc="Generating", unit="req", disable=not use_tqdm)
        open_children = {id(c.parent): 0 for c in children.values()}
        for c in children.values():
            open_children[id(c.parent)] += 1
        queue: asyncio.Queue = asyncio.Queue()
        running: set[str] = set()
        try:
            for sub in submissions:

                def submit(cid: str, sp: SamplingParams, sub: _Submission = sub) -> None:
                    lora = sub.lora
                    self.engine.submit(
                        cid, sub.prompt_token_ids, sp, queue, sub.priority, sub.group, sub.cache_salt,
                        lora.lora_name if lora else "", lora.lora_path if lora else "",
                    )  # fmt: skip
                    running.add(cid)

                sub.fanout.submit(submit, self.engine.mesh.abort)
            with bar:
                while running:
                    delta = await queue.get()
                    if isinstance(delta, Exception):
                        raise delta
                    if delta.request_id not in running:
                        continue  # e.g. the ABORT echo of a child a stop string ended
                    child = children[delta.request_id]
                    if self._absorb(child, delta):
                        running.discard(delta.request_id)
                        open_children[id(child.parent)] -= 1
                        if open_children[id(child.parent)] == 0:
                            child.parent.finished = True
                            bar.update(1)
        finally:
            for cid in running:
                self.engine.mesh.abort(cid)

    def _absorb(self, child: _Child, delta: RequestDelta) -> bool:
        """Fold a delta into the child's output; True when the child finished."""
        out = child.output
        state = child.state
        child.parent.num_cached_tokens = max(child.parent.num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None:
            child.parent._prompt_entries = delta.prompt_logprobs
        if delta.embedding is not None:
            child.parent._embedding = delta.embedding
        up = state.absorb(delta.new_token_ids, delta.finish_reason)
        if out.logprobs is not None:
            out.logprobs.extend(delta.new_logprobs[: up.num_tokens])
        if up.cancel:
            self.engine.mesh.abort(delta.request_id)  # a stop string ended it (on the loop: upstream too)
        if not state.finished:
            return False
        out.finish_reason = str(state.finish_reason)
        out.stop_reason = state.stop_reason
        return True

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    @staticmethod
    def _salt_of(prompt: Prompt) -> str:
        """A dict prompt's `cache_salt` (vLLM's): prompts of different salts share no cached block."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is None:
            return ""
        if not isinstance(salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
        try:
            check_salt(salt)
        except ValueError as e:
            raise ValueError(f"cache_salt: {e}") from e
        return salt

    @staticmethod
    def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str | dict):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    @staticmethod
    def _params_for(
        batch: list[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(batch)
        if len(sampling_params) != len(batch):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(batch)} prompts")
        return list(sampling_params)
