"""The scheduler -> worker step contract, as plain dataclasses.

The worker is stateful: it keeps each running sequence's tokens, block table and
sampling parameters. A plan carries only what changed since the last one (new
sequences in full, then per step: ids, new-token counts, appended block ids,
finished/preempted ids). The gRPC edge converts these to protobuf one to one;
in-process engines pass them directly.
"""

from __future__ import annotations

import hashlib
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
    # If this step samples the sequence's next token, propose up to this many draft tokens after
    # it (speculative decoding); the result says how many were proposed.
    max_draft_tokens: int = 0
    # The LoRA adapter it runs with ("" = the base model): the worker loads (name, path) into a
    # slot if none holds it (worker.proto NewSequence.lora_name).
    lora_name: str = ""
    lora_path: str = ""


@dataclass
class ScheduledSequence:
    """A sequence the worker already holds, scheduled again.

    Tokens past the sequence's known ones are the draft tokens the worker proposed after its
    last sampled token (speculative decoding): they are verified in this forward.
    """

    seq_id: str
    num_new_tokens: int
    new_block_ids: list[int] = field(default_factory=list)
    max_draft_tokens: int = 0  # as NewSequence.max_draft_tokens


@dataclass
class StorePut:
    """Copy one chunk of full blocks to the shared KV store under `key` (the last block's key)."""

    key: bytes
    block_ids: list[int]


@dataclass
class StoreLoad:
    """Fill a new sequence's blocks from KV store chunks before the forward.

    `keys[i]` names chunk i (consecutive chunks of the sequence's chain); `block_ids` holds
    `len(keys) * chunk_blocks` entries, chunk by chunk: the block to fill with each of the
    chunk's blocks, or -1 to skip one (its KV is already in the cache).
    """

    seq_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class CudaIpcHandle:
    """One layer's KV tensor as another process on the host opens it: the fields of torch's
    `UntypedStorage._share_cuda_()` (a CUDA IPC handle of the allocation, the storage's place in
    it, the producer's ref counter and its last write's event), sent as plain ints and bytes."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass
class KVExport:
    """A worker's paged KV cache as peers on its host can open it (worker_svc/kv_peer.py).

    kind "shm": every layer's [2, num_blocks, block_size, heads, head_dim] tensor back to back in
    the POSIX shared-memory segment `shm_name` (mode 0600, the worker's user only); kind
    "cuda_ipc": one `CudaIpcHandle` per layer. `export_id` is random per export (a peer caches
    what it opened under it); `host_id` names the host (boot id and hostname): a peer on another
    host never tries. `dtype` and `layer_shape` let a peer check the layout before it copies.
    """

    kind: str
    export_id: str
    host_id: str
    dtype: str
    num_layers: int
    layer_shape: list[int]
    shm_name: str = ""
    layers: list[CudaIpcHandle] = field(default_factory=list)


@dataclass
class PeerCopy:
    """Copy blocks of a peer worker's cache (the prefill worker of a direct handover) into this
    worker's: block src_block_ids[i] of `source` -> block dst_block_ids[i], every layer, K and V.
    Where the copy cannot be done (the peer's export does not open, the layout differs, the copy
    raises) the worker computes the sequence from its first destination block on in the same
    forward and lists it in `StepResult.failed_peer_seq_ids`."""

    seq_id: str
    source: KVExport
    src_block_ids: list[int]
    dst_block_ids: list[int]


@dataclass
class KVTransfers:
    """KV moves a plan asks for, done in this order before its forward.

    1. saves: GPU blocks computed by earlier plans -> the worker's host (CPU) tier slots;
    2. store puts: chunks of GPU blocks -> the KV store (copied now, sent in the background);
    3. host loads: host tier slots -> freshly allocated GPU blocks;
    4. store loads: KV store chunks -> freshly allocated GPU blocks. Where a chunk cannot be
       read, the worker computes that sequence from the chunk's first block on in this very
       forward (it holds the tokens) and lists it in `StepResult.failed_load_seq_ids`.
    Saves read blocks before loads overwrite any, and loads read slots before saves reuse them
    only because the scheduler never evicts a slot that the same plan loads.
    """

    save_block_ids: list[int] = field(default_factory=list)
    save_host_slots: list[int] = field(default_factory=list)
    store_puts: list[StorePut] = field(default_factory=list)
    load_host_slots: list[int] = field(default_factory=list)
    load_block_ids: list[int] = field(default_factory=list)
    store_loads: list[StoreLoad] = field(default_factory=list)
    # 5. peer copies (a direct prefill -> decode handover): a peer's blocks -> fresh GPU blocks.
    peer_copies: list[PeerCopy] = field(default_factory=list)

    def __bool__(self) -> bool:
        moves = self.save_block_ids or self.store_puts or self.load_block_ids or self.store_loads
        return bool(moves or self.peer_copies)


@dataclass
class StepPlan:
    step_id: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # drop state (finished or aborted)
    preempted_ids: list[str] = field(default_factory=list)  # drop state; will come back as new
    kv: KVTransfers = field(default_factory=KVTransfers)

    @property
    def num_seqs(self) -> int:
        return len(self.new_seqs) + len(self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.new_seqs) + sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens computed: every new sequence's, and the chunks (more than one token) of
        those scheduled; a decode's single token is not one."""
        chunks = sum(s.num_new_tokens for s in self.scheduled if s.num_new_tokens > 1)
        return sum(s.num_new_tokens for s in self.new_seqs) + chunks


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top-k alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens `first`, `first + 1`, ... of one sequence, from one forward.

    `entries[j]` is prompt token `first + j` (its `token_id`) under the distribution at the
    position before it. A chunked prefill yields one of these per chunk.
    """

    seq_id: str
    first: int
    entries: list[TokenLogprobs]


@dataclass
class PooledOutput:
    """A pooling sequence's pooled final hidden states, once its prompt is computed."""

    seq_id: str
    values: list[float]


@dataclass
class StepResult:
    """Sampled tokens for the sequences of a plan that reached the end of their known tokens.

    A sequence mid-way through a chunked prefill samples nothing this step. A sequence that
    verified draft tokens has one entry per token it gained, consecutive and in order: the
    accepted drafts, then the token sampled after them.
    """

    step_id: int
    seq_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Sequences whose store loads failed (a miss, a corrupt chunk, the store unreachable): the
    # worker computed the missing blocks in the same forward instead (informational).
    failed_load_seq_ids: list[str] = field(default_factory=list)
    # Draft tokens proposed after this step's samples (speculative decoding): the next plan may
    # verify up to num_draft_tokens[i] tokens for draft_seq_ids[i]. Absent: none proposed.
    draft_seq_ids: list[str] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)
    # Store chunks of this step's loads whose MAC failed (each a miss; services/kv_mac.py).
    kv_verify_failures: int = 0
    # Prompt logprobs this forward computed (sequences with sampling_params.prompt_logprobs).
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # Pooling sequences whose prompt this step completed (they sample nothing).
    pooled: list[PooledOutput] = field(default_factory=list)
    # Each store load of the plan, in order: blocks written, bytes, wall seconds on the worker
    # (the scheduler's load predictor learns the path's bandwidth from them).
    kv_load_blocks: list[int] = field(default_factory=list)
    kv_load_bytes: list[int] = field(default_factory=list)
    kv_load_seconds: list[float] = field(default_factory=list)
    # Peer copies of the plan (direct handovers): sequences whose copy failed (computed instead),
    # and the bytes copied and the worker's seconds for them in all.
    failed_peer_seq_ids: list[str] = field(default_factory=list)
    peer_copy_bytes: int = 0
    peer_copy_seconds: float = 0.0


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
    # Slots of the worker's host (CPU) KV tier, one block each; 0 = no host tier.
    num_host_blocks: int = 0
    # Blocks per KV store chunk (the store's unit); 0 = the worker has no KV store.
    kv_chunk_blocks: int = 0
    # Most draft tokens the worker proposes per sequence and step; 0 = no speculative decoding.
    num_speculative_tokens: int = 0
    # No drafts while more sequences than this run on the worker (0 = never disabled).
    spec_disable_by_batch_size: int = 0
    # True: the worker's proposals (n-gram) need no last token on the host, so a plan may follow
    # a proposing one before its result, and verify the drafts a token later.
    spec_drafts_ahead: bool = False
    max_num_batched_tokens: int = 0
    # LoRA: adapters the worker holds at once (0 = it serves none); the scheduler runs at most
    # this many distinct adapters on it.
    max_loras: int = 0
    max_lora_rank: int = 0  # the largest adapter rank its slots hold
    # Its part in disaggregated serving (--role): "both" (or "" from an older worker) takes whole
    # requests, "prefill" only prompts (their first token), "decode" the rest (scheduler_svc/
    # disaggregation.py).
    role: str = ""
    # Bytes of one KV block as the store holds it (0 = unknown): the load predictor's prior.
    kv_block_bytes: int = 0
    # Direct handovers between workers of one host (worker_svc/kv_peer.py): the host's identity,
    # the worker's KV cache as its peers open it (a prefill worker's; None: no export), and the
    # export kind it can open and copy from ("shm", "cuda_ipc"; "": none).
    host_id: str = ""
    kv_export: KVExport | None = None
    kv_peer_import: str = ""


def store_fingerprint(fingerprint: bytes, chunk_blocks: int) -> bytes:
    """The KV store's namespace for a worker's blocks: its fingerprint and the chunk size.

    Chunks of different sizes hold different spans under the same key, so they never mix.
    """
    return hashlib.sha256(fingerprint + b"/chunk_blocks=%d" % chunk_blocks).digest()
