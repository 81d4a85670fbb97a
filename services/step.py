"""The scheduler -> worker step contract, as plain dataclasses.

The worker is stateful: it keeps each running sequence's tokens, block table and
sampling parameters. A plan carries only what changed since the last one (new
sequences in full, then per step: ids, new-token counts, appended block ids,
finished/preempted ids). The gRPC edge converts these to protobuf one to one;
in-process engines pass them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.sampling_params import SamplingParams

# gRPC metadata key of the secret that opens a worker's Step stream (worker.proto, rpc Step).
STEP_TOKEN_METADATA = "x-llmesh-step-token"


@dataclass
class NewSequence:
    """A sequence the worker has not seen (or dropped after preemption)."""

    seq_id: str
    token_ids: list[int]  # prompt + tokens generated so far (recompute after preemption)
    num_prompt_tokens: int  # len of the prompt part of token_ids (penalties, logprobs)
    block_ids: list[int]  # blocks allocated so far, in order
    num_computed_tokens: int  # leading tokens whose KV is already in the cache (prefix hit)
    num_new_tokens: int  # tokens to compute this step, from num_computed_tokens on
    sampling_params: SamplingParams


@dataclass
class ScheduledSequence:
    """A sequence the worker already holds, scheduled again."""

    seq_id: str
    num_new_tokens: int
    new_block_ids: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    step_id: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # drop state (finished or aborted)
    preempted_ids: list[str] = field(default_factory=list)  # drop state; will come back as new

    @property
    def num_seqs(self) -> int:
        return len(self.new_seqs) + len(self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.new_seqs) + sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top-k alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class StepResult:
    """Sampled tokens for the sequences of a plan that reached the end of their known tokens.

    A sequence mid-way through a chunked prefill samples nothing this step.
    """

    step_id: int
    seq_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


@dataclass
class WorkerInfo:
    """What the scheduler needs to plan for a worker (its `GetWorkerInfo` answer)."""

    model_name: str
    fingerprint: bytes
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    worker_id: str = ""
    max_num_seqs: int = 64
    # Random per worker process start: a change means its KV cache contents are gone.
    instance_id: str = ""
