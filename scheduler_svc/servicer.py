"""The scheduler's gRPC edge: the public `Scheduler` API and the internal `Registry`.

Thin adapters over `Mesh`: protobuf in and out, validation answered with
INVALID_ARGUMENT, no worker with UNAVAILABLE, a full scheduler with
RESOURCE_EXHAUSTED and a `retry-after` (whole seconds) in the trailing metadata,
before the request sent anything. A caller that cancels (or whose deadline
passes) aborts its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc

from llmesh.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler_svc.lora import LoRAChecks
from scheduler_svc.mesh import Connected, LinkBroken, Mesh, NoWorkerAvailable, Overloaded
from scheduler_svc.planner import RequestRejected
from scheduler_svc.prefix_hash import check_salt
from scheduler_svc.request import RequestDelta, coalesce
from scheduler_svc.worker_link import GrpcWorkerLink
from services.choices import ChoiceState, FanOut, fit_max_tokens
from services.convert import (
    FINISH_REASON_TO_PROTO,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
    sampling_params_from_proto,
)
from services.grpc_server import DEFAULT_KEEPALIVE_S, ChannelSecurity
from services.limits import INLINE_TOKENIZE_CHARS, RequestLimits, prompt_char_limit
from services.sampling_params import SamplingParams, SamplingParamsError

log = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after"  # trailing metadata of RESOURCE_EXHAUSTED (generation.proto)


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """End a call with the status a refusal or failure of the mesh maps to (raises, as abort does)."""
    if isinstance(error, Overloaded):
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            str(error),
            trailing_metadata=((RETRY_AFTER_KEY, str(error.retry_after_s)),),
        )
    code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(error, RequestRejected) else None
    await context.abort(code or grpc.StatusCode.UNAVAILABLE, str(error))


@dataclass
class _Choice:
    """One of a request's n choices while it streams."""

    index: int
    request_id: str  # its id in the mesh
    state: ChoiceState  # text, stop strings, finish and stop reasons (services/choices.py)
    logprobs: bool  # the caller asked for logprobs
    cached_tokens: int = 0


@dataclass
class ModelCard:
    name: str
    root: str
    created: int = field(default_factory=lambda: int(time.time()))


class SchedulerServicer(generation_pb2_grpc.SchedulerServicer):
    def __init__(self, mesh: Mesh, card: ModelCard, limits: RequestLimits | None = None) -> None:
        self.mesh = mesh
        self.card = card
        self.limits = limits if limits is not None else RequestLimits()
        self.lora_checks = LoRAChecks()  # the adapter folders requests name (scheduler_svc/lora.py)
        self.tokenizer: Any = None  # set with set_tokenizer (text prompts, return_text, stop strings)
        self.tokenizer_pending = False  # True while it loads: text requests wait for it (UNAVAILABLE)
        self._longest_token_chars = 0
        # Caller's request id -> its choices' ids in the mesh. Those are internal (a fresh uuid per
        # request), so no caller can name, collide with or abort another request's choices.
        self._live: dict[str, list[str]] = {}

    @property
    def max_logprobs(self) -> int:
        return self.limits.max_logprobs

    def set_tokenizer(self, tokenizer: Any, longest_token_chars: int) -> None:
        """Install the tokenizer (None: the model ships none) and its longest token, which bounds
        text prompts cheaply; both are made off the event loop (`load_tokenizer_and_bound`)."""
        self._longest_token_chars = longest_token_chars
        self.tokenizer = tokenizer

    # ----- Generate -----
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        info = self.mesh.model_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        if self.tokenizer is None and self.tokenizer_pending:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is still loading its tokenizer")
        if request.model and request.model != self.card.name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served here")
        prompt = await self._prompt_of(request, context)
        params = await self._params_of(request, context, len(prompt), info.max_model_len)
        salt = await self._salt_of(request, context)
        try:
            self.lora_checks.check(request.lora_name, request.lora_path, info.max_lora_rank)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        stream_text = request.return_text and params.detokenize
        needs_text = stream_text or bool(params.stop)
        if needs_text and self.tokenizer is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "return_text and stop strings need a tokenizer"
            )
        rid = request.request_id or uuid.uuid4().hex
        if rid in self._live:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already running")
        skip_special = not request.HasField("skip_special_tokens") or request.skip_special_tokens
        # Every choice is planned (ids, seeds, parameters) before any is submitted, then they are
        # submitted all or nothing: one that fails aborts those before it.
        group = uuid.uuid4().hex
        try:
            fanout = FanOut.plan(group, params)
        except SamplingParamsError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        choices: dict[str, _Choice] = {}
        for i, (cid, child) in enumerate(zip(fanout.ids, fanout.params, strict=True)):
            state = ChoiceState(
                self.tokenizer if needs_text else None,
                stop=child.stop,
                stop_token_ids=child.stop_token_ids,
                skip_special_tokens=skip_special,
                stream_text=stream_text,
            )
            choices[cid] = _Choice(i, cid, state, child.logprobs is not None)
        queue: asyncio.Queue = asyncio.Queue()

        def submit(cid: str, child: SamplingParams) -> None:
            self.mesh.submit(
                cid, prompt, child, request.priority, queue, group=group, cache_salt=salt,
                lora_name=request.lora_name, lora_path=request.lora_path,
            )  # fmt: skip

        try:
            fanout.submit(submit, self.mesh.abort)
        except (RequestRejected, NoWorkerAvailable, Overloaded) as e:
            await abort_with(context, e)
        except Exception as e:  # a bug: every choice is aborted already; answer, do not leak
            log.exception("submitting a request failed", extra={"request_id": rid})
            await context.abort(grpc.StatusCode.INTERNAL, f"submitting the request failed: {e!r}")
        self._live[rid] = list(choices)
        try:
            first = True
            open_choices = len(choices)
            while open_choices:
                items = [await queue.get()]
                while not queue.empty():  # behind the steps: send what is pending as one message
                    items.append(queue.get_nowait())
                for item in coalesce(items):
                    if isinstance(item, Exception):  # refused (by a scheduler core), or no worker left
                        await abort_with(context, item)
                    choice = choices.get(item.request_id)
                    if choice is None or choice.state.finished:
                        continue
                    resp = self._response(rid, choice, item, stream_text)
                    if choice.state.finished:
                        open_choices -= 1
                    if first and request.WhichOneof("prompt") == "prompt_text":
                        resp.prompt_token_ids.extend(prompt)
                    first = False
                    if not open_choices:
                        resp.usage.CopyFrom(self._usage(prompt, choices))
                    yield resp
        finally:
            self._live.pop(rid, None)
            self._abort_all(choices)

    def _response(
        self, rid: str, choice: _Choice, delta: RequestDelta, return_text: bool
    ) -> generation_pb2.GenerateResponse:
        state = choice.state
        up = state.absorb(delta.new_token_ids, delta.finish_reason)
        if up.cancel:
            self.mesh.abort(choice.request_id)  # a stop string ended it: the upstream request ends here
        ids = delta.new_token_ids
        if up.num_tokens < len(ids):  # tokens after the one that completed a stop string
            ids = ids[: up.num_tokens]
        resp = generation_pb2.GenerateResponse(request_id=rid, index=choice.index, token_ids=ids)
        choice.cached_tokens = delta.num_cached_tokens
        if choice.logprobs and delta.new_logprobs:
            resp.logprobs.CopyFrom(logprobs_to_proto(delta.new_logprobs[: len(ids)], ids))
        if delta.prompt_logprobs is not None:
            resp.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(delta.prompt_logprobs))
        if delta.embedding is not None:
            resp.embedding.extend(delta.embedding)
        if return_text and up.text:
            resp.text = up.text
        if state.finished:
            resp.finish_reason = FINISH_REASON_TO_PROTO[state.finish_reason]
            if isinstance(state.stop_reason, str):
                resp.stop_string = state.stop_reason
            elif state.stop_reason is not None:
                resp.stop_token_id = state.stop_reason
        return resp

    def _usage(self, prompt: list[int], choices: dict[str, _Choice]) -> generation_pb2.Usage:
        return generation_pb2.Usage(
            prompt_tokens=len(prompt),
            completion_tokens=sum(c.state.num_tokens for c in choices.values()),
            cached_prompt_tokens=max((c.cached_tokens for c in choices.values()), default=0),
        )

    def _abort_all(self, choices: dict[str, _Choice]) -> None:
        for cid in choices:
            self.mesh.abort(cid)

    async def _prompt_of(self, request, context) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "prompt_token_ids":
            prompt = list(request.prompt_token_ids.ids)
        elif kind == "prompt_text":
            if self.tokenizer is None:
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, "text prompts need a tokenizer")
            text = request.prompt_text
            max_len = self.mesh.model_info.max_model_len
            if len(text) > prompt_char_limit(max_len, self._longest_token_chars):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"prompt_text: {len(text)} characters cannot fit the context length of {max_len} tokens",
                )
            if len(text) > INLINE_TOKENIZE_CHARS:
                prompt = await asyncio.to_thread(self.tokenizer.encode, text)
            else:
                prompt = self.tokenizer.encode(text)
        else:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "prompt: give prompt_token_ids or prompt_text"
            )
        if not prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")
        vocab = self.mesh.model_info.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt_token_ids: ids outside the vocabulary [0, {vocab}): {bad[:5]}",
            )
        return prompt

    async def _params_of(self, request, context, prompt_len: int, max_model_len: int) -> SamplingParams:
        try:
            params = sampling_params_from_proto(request.sampling_params)
            self.limits.check(params, self.mesh.model_info.vocab_size)
            fit_max_tokens(prompt_len, params.max_tokens, max_model_len)
        except SamplingParamsError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling_params: {e}")
        return params

    async def _salt_of(self, request, context) -> str:
        """The tenant's prefix-cache salt, bounded: it is hashed into every request's first key."""
        try:
            check_salt(request.cache_salt)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cache_salt: {e}")
        return request.cache_salt

    # ----- the rest of the public API -----
    async def Abort(self, request, context):
        aborted = []
        for rid in request.request_ids:
            # Each choice's stream gets its last (ABORT) delta: the Generate call ends at once.
            if any([self.mesh.abort(cid) for cid in self._live.get(rid, [])]):
                aborted.append(rid)
        return generation_pb2.AbortResponse(aborted_ids=aborted)

    def _model_info(self) -> generation_pb2.ModelInfo:
        mesh = self.mesh
        info = mesh.model_info
        msg = generation_pb2.ModelInfo(
            id=self.card.name,
            root=self.card.root,
            created=self.card.created,
            max_logprobs=self.max_logprobs,
            has_tokenizer=self.tokenizer is not None,
            num_workers=mesh.num_workers,
            # Ready = a request would be served now: a connected worker, and no tokenizer pending
            # (Generate answers UNAVAILABLE meanwhile), as the gRPC health says.
            num_ready_workers=0 if self.tokenizer_pending and self.tokenizer is None else mesh.num_connected,
        )
        if info is not None:
            msg.max_model_len = info.max_model_len
            msg.vocab_size = info.vocab_size
            msg.eos_token_ids.extend(info.eos_token_ids)
            msg.block_size = info.block_size
        return msg

    async def GetModelInfo(self, request, context):
        if request.model and request.model != self.card.name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served here")
        return self._model_info()

    async def ListModels(self, request, context):
        return generation_pb2.ListModelsResponse(models=[self._model_info()])

    async def Tokenize(self, request, context):
        if self.tokenizer is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this scheduler holds no tokenizer")
        add_special = not request.HasField("add_special_tokens") or request.add_special_tokens
        ids = self.tokenizer.encode(request.text, add_special_tokens=add_special)
        info = self.mesh.model_info
        return generation_pb2.TokenizeResponse(token_ids=ids, max_model_len=info.max_model_len if info else 0)

    async def Detokenize(self, request, context):
        if self.tokenizer is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this scheduler holds no tokenizer")
        vocab = self.mesh.model_info.vocab_size if self.mesh.model_info else len(self.tokenizer)
        bad = [t for t in request.token_ids if not 0 <= t < vocab]
        if bad:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"token_ids: outside [0, {vocab}): {bad[:5]}"
            )
        skip = not request.HasField("skip_special_tokens") or request.skip_special_tokens
        return generation_pb2.DetokenizeResponse(
            text=self.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
        )


class RegistryServicer(worker_pb2_grpc.RegistryServicer):
    """Workers announce themselves; the scheduler dials back and starts planning for them."""

    def __init__(
        self,
        mesh: Mesh,
        step_timeout_s: float = 300.0,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        security: ChannelSecurity | None = None,
    ) -> None:
        self.mesh = mesh
        self.step_timeout_s = step_timeout_s
        self.keepalive_s = keepalive_s
        self.security = security  # how the scheduler dials workers back (TLS, internal key)
        self.addresses: dict[str, str] = {}

    async def RegisterWorker(self, request, context):
        if not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address: must be host:port")
        try:
            worker_id = await self.connect(request.address, request.worker_id, request.step_token)
        except LinkBroken as e:
            return worker_pb2.RegisterWorkerResponse(accepted=False, message=str(e))
        return worker_pb2.RegisterWorkerResponse(accepted=True, message=f"registered as {worker_id}")

    async def connect(self, address: str, expected_id: str = "", step_token: str = "") -> str:
        """Dial a worker back and plan for it; a registration of a live worker changes nothing."""
        link = GrpcWorkerLink(address, self.step_timeout_s, step_token, self.keepalive_s, self.security)
        try:
            info = await link.probe()
            worker_id = info.worker_id or expected_id or address
            if expected_id and info.worker_id and expected_id != info.worker_id:
                raise LinkBroken(f"worker at {address} reports id {info.worker_id!r}, not {expected_id!r}")
            others = [s.info for wid, s in self.mesh.workers.items() if wid != worker_id]
            if others and others[0].fingerprint != info.fingerprint:
                raise LinkBroken(f"worker {worker_id} serves another model or cache layout")
            slot = self.mesh.workers.get(worker_id)
            if slot is not None and slot.info.instance_id == info.instance_id:
                # The same process again (a replayed or repeated registration): keep its stream.
                # A worker registers again only when it has lost its stream: if it indeed has
                # none, ours is half-dead, so drop it now; if ours is being re-dialled, try now.
                if slot.connected and not await link.stepping():
                    slot.link.abandon()
                slot.redial_now.set()
                await link.close()
                return worker_id
            if slot is not None and await self._still_live(worker_id, slot):
                raise LinkBroken(
                    f"worker {worker_id} is live at {self.addresses.get(worker_id, '?')}: a registration "
                    "from another process cannot replace it"
                )
            connected: Connected = await link.connect()
        except BaseException:
            await link.close()
            raise
        if slot is not None:  # a restarted worker: its old cache and sequences are gone
            await self.mesh.replace_worker(worker_id, connected.info, link)
        else:
            self.mesh.add_worker(worker_id, connected.info, link)
        self.addresses[worker_id] = address
        return worker_id

    async def _still_live(self, worker_id: str, slot) -> bool:
        """Whether the process registered as `worker_id` still answers as itself at its address.

        A registration binds an id to a process (its instance_id): another process may take the id
        over only once that one is gone (a restarted worker), so that no holder of the mesh secret
        can hijack a live worker's traffic by registering its id at an address of its own."""
        old = GrpcWorkerLink(
            self.addresses.get(worker_id, ""), self.step_timeout_s, "", self.keepalive_s, self.security
        )
        try:
            info = await old.probe(timeout_s=2.0)
        except LinkBroken:
            return False
        finally:
            await old.close()
        return info.worker_id == worker_id and info.instance_id == slot.info.instance_id

    async def GetStats(self, request, context):
        stats = self.mesh.stats()
        msg = worker_pb2.SchedulerStats(
            failovers=stats["failovers"],
            active_requests=stats["streams"],
            refused=stats["refused"],
            backlog=stats["backlog"],
            **{k: v for k, v in stats.items() if k.startswith("pd_")},
        )
        for wid, w in stats["workers"].items():
            msg.workers.add(worker_id=wid, address=self.addresses.get(wid, ""), **w)
        return msg
