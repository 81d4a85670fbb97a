"""The offline API: `LLM(model=None, **config).generate(prompts, SamplingParams)`."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from llmesh.engine import EngineConfig, LLMEngine
from scheduler_svc.request import FinishReason, RequestDelta
from services.detokenizer import IncrementalDetokenizer, find_stop
from services.sampling_params import SamplingParams
from services.step import TokenLogprobs
from worker_svc.loader import load_tokenizer

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


@dataclass
class _Child:
    """One of a request's n samples while it runs."""

    parent: RequestOutput
    output: CompletionOutput
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    text_at_end: bool = False  # decode the whole output once when it finishes


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
    ) -> list[RequestOutput]:
        batch = self._as_batch(prompts)
        params = self._params_for(batch, sampling_params)
        children: dict[str, _Child] = {}
        outputs: list[RequestOutput] = []
        submissions: list[tuple[str, list[int], SamplingParams, int, str]] = []
        for i, (prompt, sp) in enumerate(zip(batch, params, strict=True)):
            text, token_ids = self._tokenize(prompt)
            self.engine.check_prompt(token_ids)
            out = RequestOutput(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=token_ids)
            outputs.append(out)
            for j in range(sp.n):
                # Children of a seeded request get distinct, reproducible seeds (vLLM convention).
                child_sp = (
                    sp
                    if sp.n == 1
                    else dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + j)
                )
                cid = f"{out.request_id}-{j}"
                submissions.append((cid, token_ids, child_sp, priority[i] if priority else 0, out.request_id))
                # Nothing streams here: text is decoded once at the end, unless stop strings must
                # be matched as tokens arrive (two decodes per token, on the engine's loop).
                detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer and sp.stop else None
                text_at_end = self.tokenizer is not None and sp.detokenize and not sp.stop
                comp = CompletionOutput(j, "", [], None, [] if sp.logprobs is not None else None)
                out.outputs.append(comp)
                children[cid] = _Child(out, comp, child_sp, detok, text_at_end)
        future = asyncio.run_coroutine_threadsafe(
            self._run(children, submissions, len(outputs), use_tqdm), self.engine.loop
        )
        try:
            future.result()
        except BaseException:
            future.cancel()  # the coroutine's cleanup aborts every child still running
            raise
        return outputs

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

    # ----- internals -----
    async def _run(
        self,
        children: dict[str, _Child],
        submissions: list[tuple[str, list[int], SamplingParams, int, str]],
        num_requests: int,
        use_tqdm: bool,
    ) -> None:
        """On the engine's loop: submit every child, fold the deltas in as steps produce them.

        Runs while the model runner steps on its own thread, so detokenization and
        stop strings overlap the next step instead of sitting between two.
        """
        bar = tqdm(total=num_requests, desc="Generating", unit="req", disable=not use_tqdm)
        open_children = {id(c.parent): 0 for c in children.values()}
        for c in children.values():
            open_children[id(c.parent)] += 1
        queue: asyncio.Queue = asyncio.Queue()
        running: set[str] = set()
        try:
            for cid, token_ids, sp, prio, group in submissions:
                self.engine.submit(cid, token_ids, sp, queue, prio, group)
                running.add(cid)
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
        child.parent.num_cached_tokens = max(child.parent.num_cached_tokens, delta.num_cached_tokens)
        out.token_ids.extend(delta.new_token_ids)
        if out.logprobs is not None:
            out.logprobs.extend(delta.new_logprobs)
        finish = delta.finish_reason
        if child.detok is not None:
            new_text = child.detok.push(delta.new_token_ids)
            if finish is not None:
                new_text += child.detok.flush()
            if child.params.stop and new_text:
                idx = find_stop(child.detok.text, len(new_text), child.params.stop)
                if idx != -1:
                    stop = next(s for s in child.params.stop if child.detok.text.startswith(s, idx))
                    child.detok.text = child.detok.text[:idx]
                    out.stop_reason = stop
                    if finish is None:
                        self.engine.mesh.abort(delta.request_id)  # on the loop: ends it upstream
                    finish = FinishReason.STOP
            out.text = child.detok.text
        if finish is None:
            return False
        if child.text_at_end:
            out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        out.finish_reason = finish.value
        if finish is FinishReason.STOP and out.stop_reason is None and out.token_ids:
            stop_id = out.token_ids[-1]
            out.stop_reason = stop_id if stop_id in child.params.stop_token_ids else None
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
