"""A generation request as the scheduler tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from scheduler_svc.prefix_hash import root_key
from services.lora_config import lora_cache_root
from services.sampling_params import SamplingParams
from services.step import KVExport, TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


@dataclass
class PeerBlocks:
    """A prompt's KV in a prefill worker's cache, for a decode worker to copy (a direct handover):
    block i of the prompt is `block_ids[i]` there; the prompt is `num_tokens` long."""

    worker_id: str
    export: KVExport
    block_ids: list[int]
    num_tokens: int
    planned: bool = False  # a decode plan copies them (the prefill side holds them until its result)


@dataclass(eq=False)  # identity: `req in running` must not compare token lists field by field
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    priority: int = 0  # lower runs first under the priority policy (vLLM convention)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens the worker has (or will have, once plans in flight run) computed KV for.
    num_computed_tokens: int = 0
    # Tokens sampled by plans in flight whose results are not applied yet.
    num_pending: int = 0
    # Bumped each time the request restarts from scratch (preemption, a worker lost): results
    # of plans made for an earlier incarnation are ignored.
    incarnation: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule (-1 = not yet scheduled)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    # The caller's request this sequence belongs to (its n choices share it): the unit of fairness.
    group: str = ""
    # Leading blocks of the prompt the KV store holds (found by a lookup when it arrived); the
    # request waits while `kv_lookup_pending`.
    store_hit_blocks: int = 0
    kv_lookup_pending: bool = False
    # Handed over by a prefill worker (scheduler_svc/disaggregation.py): its prompt's store hit is
    # loaded whole, never recomputed on the decode worker by the load predictor's choice.
    handed_over: bool = False
    # Direct handovers (scheduler_svc/disaggregation.py). On a prefill worker: keep the blocks
    # referenced when its first token finishes it (the decode worker copies them). On a decode
    # worker: where its prompt's KV is to be copied from, until a plan copies it.
    hold_blocks: bool = False
    peer: PeerBlocks | None = None
    # Speculative decoding (scheduler_svc/spec_decode.py): drafts the worker holds for this
    # sequence; whether a plan in flight verifies or proposes drafts for it (it is not planned
    # again before that result); the adaptive back-off.
    num_drafts: int = 0
    draft_base: int = 0  # num_tokens when the worker proposed them (the first is for that position)
    awaiting_result: bool = False
    spec_skip: int = 0
    spec_failures: int = 0
    # Tenant isolation of the prefix cache (vLLM's cache_salt): the salt picks the root of the
    # request's block-key chain, computed once here (scheduler_svc/prefix_hash.py).
    cache_salt: str = ""
    cache_root: bytes = field(init=False, repr=False)
    # The LoRA adapter it runs with ("" = the base model): the worker loads the folder at
    # lora_path; the adapter is folded into cache_root, so its KV is its own (services/lora_config).
    lora_name: str = ""
    lora_path: str = ""
    # sampling_params.prompt_logprobs: one entry per prompt position (None at 0) as the worker's
    # chunks arrive, sent with the first token; until then the prompt takes no prefix hit.
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None, init=False, repr=False)
    prompt_logprobs_sent: bool = False
    # A pooling request's vector (sampling_params.pooling), once its prompt is computed.
    embedding: list[float] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.group:
            self.group = self.request_id
        self.cache_root = lora_cache_root(root_key(self.cache_salt), self.lora_name, self.lora_path)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt must be computed, not found in a cache: its logprobs are still wanted."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def is_pooling(self) -> bool:
        """A pooling request (embeddings): its prompt is computed and pooled, nothing sampled."""
        return self.sampling_params.pooling is not None

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position's output is read (prompt logprobs, pooling): no prefix hit."""
        return self.needs_prompt_logprobs or self.is_pooling

    def restart(self) -> None:
        """Forget the worker-side progress: recomputed from prompt + output tokens so far."""
        self.num_computed_tokens = 0
        self.num_pending = 0
        self.num_drafts = 0
        self.awaiting_result = False
        self.incarnation += 1

    def moved(self, sampling_params: SamplingParams | None = None, handed_over: bool = False) -> Request:
        """This request as another worker gets it: the same id, prompt and tokens so far (kept,
        not streamed again), no worker-side state (a failover, or a prefill worker's handover)."""
        return Request(
            self.request_id,
            self.prompt_token_ids,
            sampling_params or self.sampling_params,
            self.eos_token_ids,
            self.priority,
            self.arrival_time,
            list(self.output_token_ids),
            list(self.output_logprobs),
            group=self.group,
            cache_salt=self.cache_salt,
            lora_name=self.lora_name,
            lora_path=self.lora_path,
            handed_over=handed_over,
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(slots=True)  # one per sampled sequence per step: slots make it cheaper to build
class RequestDelta:
    """What one step produced for a request: the unit streamed to callers."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # The prompt's logprobs (entry per position, None at 0), on the first delta with tokens.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None  # a pooling request's vector, on its last delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def copy(self) -> RequestDelta:
        """A delta of its own (its lists too), to merge later deltas into."""
        return RequestDelta(
            self.request_id,
            list(self.new_token_ids),
            list(self.new_logprobs),
            self.finish_reason,
            self.num_prompt_tokens,
            self.num_output_tokens,
            self.num_cached_tokens,
            self.prompt_logprobs,
            self.embedding,
        )

    def merge(self, later: RequestDelta) -> None:
        """Append a later delta of the same request (this one must be a copy of its own)."""
        self.new_token_ids.extend(later.new_token_ids)
        self.new_logprobs.extend(later.new_logprobs)
        self.finish_reason = later.finish_reason
        self.num_output_tokens = later.num_output_tokens
        self.num_cached_tokens = later.num_cached_tokens
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.embedding is not None:
            self.embedding = later.embedding


def coalesce(items: list) -> list:
    """Merge queued deltas of the same request into one, in order; an exception ends the list.

    A caller that reads slower than steps produce tokens then gets one message with
    everything pending instead of a backlog of one-token messages (which only makes the
    reader slower still). `items` holds RequestDeltas and, possibly, an Exception.
    """
    if len(items) == 1:
        return items  # the usual case, a reader keeping up: nothing to merge, nothing to copy
    out: list = []
    latest: dict[str, RequestDelta] = {}
    for item in items:
        if isinstance(item, Exception):
            out.append(item)
            break
        prev = latest.get(item.request_id)
        if prev is None or prev.finished:
            merged = item.copy()
            latest[item.request_id] = merged
            out.append(merged)
            continue
        prev.merge(item)
    return out
