"""Conversion at the gRPC edge: services' dataclasses <-> llmesh.v1 protobuf messages.

Core logic (scheduler planner, model runner) takes and returns the plain
dataclasses of services/step.py and services/sampling_params.py; servicers and
clients call these functions and nothing else touches protobuf.

Every conversion is lossless both ways, with two conventions the wire imposes:
- logprobs travel as float32 (what the sampler computes them in), so values
  that are not float32-representable come back rounded to float32;
- `StepResult.logprobs` decodes to one entry per sampled token (None where the
  sequence asked for none), the shape the worker produces; an empty list with
  tokens encodes as "no logprobs" and decodes as all None.

Malformed messages (column lengths that disagree) raise `ValueError`; invalid
sampling parameters raise `SamplingParamsError`. Servicers map both to
INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from llmesh.v1 import generation_pb2, worker_pb2
from services.choices import ABORT, LENGTH, STOP
from services.sampling_params import SamplingParams, SamplingParamsError
from services.step import (
    CudaIpcHandle,
    KVExport,
    KVTransfers,
    NewSequence,
    PeerCopy,
    PooledOutput,
    PromptLogprobs,
    ScheduledSequence,
    StepPlan,
    StepResult,
    StoreLoad,
    StorePut,
    TokenLogprobs,
    WorkerInfo,
)
from services.structured_outputs import StructuredOutputs

# Engine defaults for proto fields left unset (proto3 `optional`). Read from the
# dataclass so that the two cannot drift.
_SP_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}

# -- sampling parameters -----------------------------------------------------------

# SamplingParams.pooling on the wire (generation.proto's Pooling), and back.
POOLING_TO_PROTO = {
    "default": generation_pb2.POOLING_DEFAULT,
    "last": generation_pb2.POOLING_LAST,
    "mean": generation_pb2.POOLING_MEAN,
    "cls": generation_pb2.POOLING_CLS,
}
POOLING_FROM_PROTO = {wire: name for name, wire in POOLING_TO_PROTO.items()}

# services/choices.py's finish reasons (the scheduler's FinishReason values) on the wire, and back.
FINISH_REASON_TO_PROTO = {
    STOP: generation_pb2.FINISH_REASON_STOP,
    LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    ABORT: generation_pb2.FINISH_REASON_ABORT,
}
FINISH_REASON_FROM_PROTO = {wire: reason for reason, wire in FINISH_REASON_TO_PROTO.items()}


def sampling_params_to_proto(sp: SamplingParams) -> generation_pb2.SamplingParams:
    msg = generation_pb2.SamplingParams(
        n=sp.n,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        min_tokens=sp.min_tokens,
        stop_token_ids=sp.stop_token_ids,
        stop=sp.stop,
        ignore_eos=sp.ignore_eos,
        max_logprobs=sp.max_logprobs,
        detokenize=sp.detokenize,
    )
    # None means "unset" on the wire (seed: random, max_tokens: to the context
    # length, logprobs: none), so these are only set when present.
    if sp.seed is not None:
        msg.seed = sp.seed
    if sp.max_tokens is not None:
        msg.max_tokens = sp.max_tokens
    if sp.logprobs is not None:
        msg.logprobs = sp.logprobs
    if sp.prompt_logprobs is not None:
        msg.prompt_logprobs = sp.prompt_logprobs
    if sp.pooling is not None:
        msg.pooling = POOLING_TO_PROTO[sp.pooling]
    if sp.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_outputs_to_proto(sp.structured_outputs))
    return msg


def structured_outputs_to_proto(so: StructuredOutputs) -> generation_pb2.StructuredOutputs:
    msg = generation_pb2.StructuredOutputs()
    if so.json is not None:
        msg.json = so.json
    elif so.json_object:
        msg.json_object = True
    elif so.regex is not None:
        msg.regex = so.regex
    elif so.choice is not None:
        msg.choice.values.extend(so.choice)
    elif so.grammar is not None:
        msg.grammar = so.grammar
    return msg


def structured_outputs_from_proto(msg: generation_pb2.StructuredOutputs) -> StructuredOutputs:
    """Not validated here: SamplingParams validates it (an empty oneof is refused there)."""
    which = msg.WhichOneof("spec")
    if which == "choice":
        return StructuredOutputs(choice=tuple(msg.choice.values))
    if which is None:
        return StructuredOutputs()
    return StructuredOutputs(**{which: getattr(msg, which)})


def sampling_params_from_proto(msg: generation_pb2.SamplingParams) -> SamplingParams:
    """Proto -> validated SamplingParams (raises SamplingParamsError on bad values)."""

    def opt(name: str, unset: object) -> object:
        return getattr(msg, name) if msg.HasField(name) else unset

    return SamplingParams(
        n=opt("n", _SP_DEFAULTS["n"]),
        temperature=opt("temperature", _SP_DEFAULTS["temperature"]),
        top_p=opt("top_p", _SP_DEFAULTS["top_p"]),
        top_k=msg.top_k,
        min_p=msg.min_p,
        repetition_penalty=opt("repetition_penalty", _SP_DEFAULTS["repetition_penalty"]),
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=opt("seed", None),
        # Unset = up to the context length (the dataclass default of 16 is the
        # offline API's; a gRPC client that wants 16 says so).
        max_tokens=opt("max_tokens", None),
        min_tokens=msg.min_tokens,
        stop_token_ids=list(msg.stop_token_ids),
        stop=list(msg.stop),
        ignore_eos=msg.ignore_eos,
        logprobs=opt("logprobs", None),
        prompt_logprobs=opt("prompt_logprobs", None),
        pooling=_pooling_from_proto(msg.pooling),
        max_logprobs=opt("max_logprobs", _SP_DEFAULTS["max_logprobs"]),
        detokenize=opt("detokenize", _SP_DEFAULTS["detokenize"]),
        structured_outputs=(
            structured_outputs_from_proto(msg.structured_outputs)
            if msg.HasField("structured_outputs")
            else None
        ),
    )


def _pooling_from_proto(value: int) -> str | None:
    if value == generation_pb2.POOLING_NONE:
        return None
    if value not in POOLING_FROM_PROTO:
        raise SamplingParamsError("pooling", f"unknown value {value}")
    return POOLING_FROM_PROTO[value]


# -- logprobs ----------------------------------------------------------------------


def logprobs_to_proto(
    entries: Sequence[TokenLogprobs | None], token_ids: Sequence[int]
) -> generation_pb2.Logprobs:
    """Pack per-token logprobs (None = none for that token) into parallel columns.

    `entries` is parallel to `token_ids`, or empty for "no logprobs at all". The
    sampled token id is not repeated on the wire: it is token_ids[i].
    """
    msg = generation_pb2.Logprobs()
    if not entries:
        return msg
    if len(entries) != len(token_ids):
        raise ValueError(f"{len(entries)} logprobs entries for {len(token_ids)} tokens")
    index: list[int] = []
    logprob: list[float] = []
    rank: list[int] = []
    num_top: list[int] = []
    top_ids: list[int] = []
    top_lps: list[float] = []
    for i, e in enumerate(entries):
        if e is None:
            continue
        if e.token_id != token_ids[i]:
            raise ValueError(
                f"logprobs entry {i} is for token {e.token_id}, but token {token_ids[i]} was sampled"
            )
        if len(e.top_token_ids) != len(e.top_logprobs):
            raise ValueError(
                f"logprobs entry {i}: {len(e.top_token_ids)} top ids, {len(e.top_logprobs)} logprobs"
            )
        index.append(i)
        logprob.append(e.logprob)
        rank.append(e.rank)
        num_top.append(len(e.top_token_ids))
        top_ids.extend(e.top_token_ids)
        top_lps.extend(e.top_logprobs)
    msg.token_index.extend(index)
    msg.logprob.extend(logprob)
    msg.rank.extend(rank)
    msg.num_top.extend(num_top)
    msg.top_token_ids.extend(top_ids)
    msg.top_logprobs.extend(top_lps)
    return msg


def logprobs_from_proto(msg: generation_pb2.Logprobs, token_ids: Sequence[int]) -> list[TokenLogprobs | None]:
    """Unpack to one entry per token of `token_ids` (None where it has no logprobs)."""
    out: list[TokenLogprobs | None] = [None] * len(token_ids)
    n = len(msg.token_index)
    if not (len(msg.logprob) == len(msg.rank) == len(msg.num_top) == n):
        raise ValueError("Logprobs columns token_index/logprob/rank/num_top differ in length")
    if len(msg.top_token_ids) != len(msg.top_logprobs) or sum(msg.num_top) != len(msg.top_token_ids):
        raise ValueError("Logprobs top_token_ids/top_logprobs do not match num_top")
    index, logprob, rank, num_top = (
        list(msg.token_index),
        list(msg.logprob),
        list(msg.rank),
        list(msg.num_top),
    )
    top_ids, top_lps = list(msg.top_token_ids), list(msg.top_logprobs)
    pos = 0
    for j, i in enumerate(index):
        if i >= len(token_ids) or out[i] is not None:
            raise ValueError(f"Logprobs token_index {i} is out of range or repeated")
        k = num_top[j]
        out[i] = TokenLogprobs(
            token_id=token_ids[i],
            logprob=logprob[j],
            rank=rank[j],
            top_token_ids=top_ids[pos : pos + k],
            top_logprobs=top_lps[pos : pos + k],
        )
        pos += k
    return out


def prompt_logprobs_to_proto(entries: Sequence[TokenLogprobs | None]) -> generation_pb2.Logprobs:
    """A whole prompt's logprobs (entry i for prompt position i, None at 0), as GenerateResponse
    and CoreDelta carry them: token_index is the prompt position."""
    return logprobs_to_proto(entries, [e.token_id if e is not None else 0 for e in entries])


def prompt_logprobs_from_proto(
    msg: generation_pb2.Logprobs, prompt: Sequence[int]
) -> list[TokenLogprobs | None]:
    """One entry per prompt position; None where there is none (always position 0)."""
    return logprobs_from_proto(msg, prompt)


def prompt_chunk_to_proto(chunk: PromptLogprobs) -> worker_pb2.PromptLogprobs:
    token_ids = [e.token_id for e in chunk.entries]
    return worker_pb2.PromptLogprobs(
        seq_id=chunk.seq_id,
        first=chunk.first,
        token_ids=token_ids,
        logprobs=logprobs_to_proto(chunk.entries, token_ids),
    )


def prompt_chunk_from_proto(msg: worker_pb2.PromptLogprobs) -> PromptLogprobs:
    token_ids = list(msg.token_ids)
    entries = logprobs_from_proto(msg.logprobs, token_ids)
    if any(e is None for e in entries):
        raise ValueError(f"PromptLogprobs of {msg.seq_id!r}: every token needs an entry")
    return PromptLogprobs(msg.seq_id, msg.first, entries)  # type: ignore[arg-type]


# -- step plan ---------------------------------------------------------------------


def new_sequence_to_proto(seq: NewSequence) -> worker_pb2.NewSequence:
    return worker_pb2.NewSequence(
        seq_id=seq.seq_id,
        token_ids=seq.token_ids,
        num_prompt_tokens=seq.num_prompt_tokens,
        block_ids=seq.block_ids,
        num_computed_tokens=seq.num_computed_tokens,
        num_new_tokens=seq.num_new_tokens,
        sampling_params=sampling_params_to_proto(seq.sampling_params),
        max_draft_tokens=seq.max_draft_tokens,
        lora_name=seq.lora_name,
        lora_path=seq.lora_path,
    )


def new_sequence_from_proto(msg: worker_pb2.NewSequence) -> NewSequence:
    return NewSequence(
        seq_id=msg.seq_id,
        token_ids=list(msg.token_ids),
        num_prompt_tokens=msg.num_prompt_tokens,
        block_ids=list(msg.block_ids),
        num_computed_tokens=msg.num_computed_tokens,
        num_new_tokens=msg.num_new_tokens,
        sampling_params=sampling_params_from_proto(msg.sampling_params),
        max_draft_tokens=msg.max_draft_tokens,
        lora_name=msg.lora_name,
        lora_path=msg.lora_path,
    )


def step_plan_to_proto(plan: StepPlan) -> worker_pb2.StepPlan:
    msg = worker_pb2.StepPlan(
        step_id=plan.step_id,
        new_seqs=[new_sequence_to_proto(s) for s in plan.new_seqs],
        finished_ids=plan.finished_ids,
        preempted_ids=plan.preempted_ids,
    )
    # Scheduled sequences go as columns: one message per plan, not per sequence.
    sched = msg.scheduled
    sched.seq_ids.extend([s.seq_id for s in plan.scheduled])
    sched.num_new_tokens.extend([s.num_new_tokens for s in plan.scheduled])
    sched.num_new_block_ids.extend([len(s.new_block_ids) for s in plan.scheduled])
    sched.new_block_ids.extend([b for s in plan.scheduled for b in s.new_block_ids])
    if any(s.max_draft_tokens for s in plan.scheduled):
        sched.max_draft_tokens.extend([s.max_draft_tokens for s in plan.scheduled])
    if plan.kv:
        kv = plan.kv
        msg.kv.CopyFrom(
            worker_pb2.KVTransfers(
                save_block_ids=kv.save_block_ids,
                save_host_slots=kv.save_host_slots,
                store_puts=[worker_pb2.StorePut(key=p.key, block_ids=p.block_ids) for p in kv.store_puts],
                load_host_slots=kv.load_host_slots,
                load_block_ids=kv.load_block_ids,
                store_loads=[
                    worker_pb2.StoreLoad(seq_id=s.seq_id, keys=s.keys, block_ids=s.block_ids)
                    for s in kv.store_loads
                ],
                peer_copies=[peer_copy_to_proto(c) for c in kv.peer_copies],
            )
        )
    return msg


def kv_transfers_from_proto(msg: worker_pb2.KVTransfers) -> KVTransfers:
    kv = KVTransfers(
        save_block_ids=list(msg.save_block_ids),
        save_host_slots=list(msg.save_host_slots),
        store_puts=[StorePut(p.key, list(p.block_ids)) for p in msg.store_puts],
        load_host_slots=list(msg.load_host_slots),
        load_block_ids=list(msg.load_block_ids),
        store_loads=[StoreLoad(s.seq_id, list(s.keys), list(s.block_ids)) for s in msg.store_loads],
        peer_copies=[peer_copy_from_proto(c) for c in msg.peer_copies],
    )
    for c in kv.peer_copies:
        if len(c.src_block_ids) != len(c.dst_block_ids):
            raise ValueError(f"PeerCopy {c.seq_id!r}: src_block_ids and dst_block_ids differ in length")
    if len(kv.save_block_ids) != len(kv.save_host_slots):
        raise ValueError("KVTransfers: save_block_ids and save_host_slots differ in length")
    if len(kv.load_block_ids) != len(kv.load_host_slots):
        raise ValueError("KVTransfers: load_block_ids and load_host_slots differ in length")
    return kv


def step_plan_from_proto(msg: worker_pb2.StepPlan) -> StepPlan:
    sched = msg.scheduled
    seq_ids, num_new, num_blocks = (
        list(sched.seq_ids),
        list(sched.num_new_tokens),
        list(sched.num_new_block_ids),
    )
    blocks = list(sched.new_block_ids)
    drafts = list(sched.max_draft_tokens) or [0] * len(seq_ids)
    if not (len(num_new) == len(num_blocks) == len(seq_ids) == len(drafts)):
        raise ValueError(
            "ScheduledSequences columns seq_ids/num_new_tokens/num_new_block_ids/max_draft_tokens "
            "differ in length"
        )
    if sum(num_blocks) != len(blocks):
        raise ValueError(
            f"ScheduledSequences: num_new_block_ids sum to {sum(num_blocks)}, got {len(blocks)} ids"
        )
    scheduled: list[ScheduledSequence] = []
    pos = 0
    for seq_id, n, k, d in zip(seq_ids, num_new, num_blocks, drafts, strict=True):
        scheduled.append(
            ScheduledSequence(
                seq_id=seq_id, num_new_tokens=n, new_block_ids=blocks[pos : pos + k], max_draft_tokens=d
            )
        )
        pos += k
    return StepPlan(
        step_id=msg.step_id,
        new_seqs=[new_sequence_from_proto(s) for s in msg.new_seqs],
        scheduled=scheduled,
        finished_ids=list(msg.finished_ids),
        preempted_ids=list(msg.preempted_ids),
        kv=kv_transfers_from_proto(msg.kv),
    )


# -- step result -------------------------------------------------------------------


def step_result_to_proto(result: StepResult) -> worker_pb2.StepResult:
    if len(result.seq_ids) != len(result.token_ids):
        raise ValueError(f"StepResult: {len(result.seq_ids)} seq_ids, {len(result.token_ids)} token_ids")
    msg = worker_pb2.StepResult(
        step_id=result.step_id,
        seq_ids=result.seq_ids,
        token_ids=result.token_ids,
        failed_load_seq_ids=result.failed_load_seq_ids,
        draft_seq_ids=result.draft_seq_ids,
        num_draft_tokens=result.num_draft_tokens,
        kv_verify_failures=result.kv_verify_failures,
        prompt_logprobs=[prompt_chunk_to_proto(c) for c in result.prompt_logprobs],
        pooled=[worker_pb2.PooledOutput(seq_id=p.seq_id, values=p.values) for p in result.pooled],
        kv_load_blocks=result.kv_load_blocks,
        kv_load_bytes=result.kv_load_bytes,
        kv_load_seconds=result.kv_load_seconds,
        failed_peer_seq_ids=result.failed_peer_seq_ids,
        peer_copy_bytes=result.peer_copy_bytes,
        peer_copy_seconds=result.peer_copy_seconds,
    )
    if len(result.draft_seq_ids) != len(result.num_draft_tokens):
        raise ValueError("StepResult: draft_seq_ids and num_draft_tokens differ in length")
    if any(e is not None for e in result.logprobs):
        msg.logprobs.CopyFrom(logprobs_to_proto(result.logprobs, result.token_ids))
    elif result.logprobs and len(result.logprobs) != len(result.token_ids):
        raise ValueError(
            f"StepResult: {len(result.logprobs)} logprobs entries for {len(result.token_ids)} tokens"
        )
    return msg


def step_result_from_proto(msg: worker_pb2.StepResult) -> StepResult:
    seq_ids, token_ids = list(msg.seq_ids), list(msg.token_ids)
    if len(seq_ids) != len(token_ids):
        raise ValueError(f"StepResult: {len(seq_ids)} seq_ids, {len(token_ids)} token_ids")
    if len(msg.draft_seq_ids) != len(msg.num_draft_tokens):
        raise ValueError("StepResult: draft_seq_ids and num_draft_tokens differ in length")
    return StepResult(
        step_id=msg.step_id,
        seq_ids=seq_ids,
        token_ids=token_ids,
        logprobs=logprobs_from_proto(msg.logprobs, token_ids),
        failed_load_seq_ids=list(msg.failed_load_seq_ids),
        draft_seq_ids=list(msg.draft_seq_ids),
        num_draft_tokens=list(msg.num_draft_tokens),
        kv_verify_failures=msg.kv_verify_failures,
        prompt_logprobs=[prompt_chunk_from_proto(c) for c in msg.prompt_logprobs],
        pooled=[PooledOutput(p.seq_id, list(p.values)) for p in msg.pooled],
        kv_load_blocks=list(msg.kv_load_blocks),
        kv_load_bytes=list(msg.kv_load_bytes),
        kv_load_seconds=list(msg.kv_load_seconds),
        failed_peer_seq_ids=list(msg.failed_peer_seq_ids),
        peer_copy_bytes=msg.peer_copy_bytes,
        peer_copy_seconds=msg.peer_copy_seconds,
    )


# -- worker info -------------------------------------------------------------------

# WorkerInfo fields mirror the proto by name; proto-only fields (dtype, device,
# ...) are passed as keyword arguments / returned separately.
_WORKER_INFO_FIELDS = [f.name for f in dataclasses.fields(WorkerInfo)]


def worker_info_to_proto(info: WorkerInfo, **proto_only: object) -> worker_pb2.WorkerInfo:
    """`proto_only` sets fields the dataclass lacks, e.g. instance_id=..., device=...."""
    values = {name: getattr(info, name) for name in _WORKER_INFO_FIELDS}
    export = values.pop("kv_export")
    values.update(proto_only)
    msg = worker_pb2.WorkerInfo(**values)
    if export is not None:
        msg.kv_export.CopyFrom(kv_export_to_proto(export))
    return msg


def worker_info_from_proto(msg: worker_pb2.WorkerInfo) -> WorkerInfo:
    values = {name: getattr(msg, name) for name in _WORKER_INFO_FIELDS}
    values["eos_token_ids"] = list(values["eos_token_ids"])
    values["kv_export"] = kv_export_from_proto(msg.kv_export) if msg.HasField("kv_export") else None
    return WorkerInfo(**values)


# -- direct handovers (worker_svc/kv_peer.py) ---------------------------------------

_IPC_FIELDS = [f.name for f in dataclasses.fields(CudaIpcHandle)]


def kv_export_to_proto(e: KVExport) -> worker_pb2.KVExport:
    return worker_pb2.KVExport(
        kind=e.kind,
        export_id=e.export_id,
        host_id=e.host_id,
        dtype=e.dtype,
        num_layers=e.num_layers,
        layer_shape=e.layer_shape,
        shm_name=e.shm_name,
        layers=[worker_pb2.CudaIpcHandle(**dataclasses.asdict(h)) for h in e.layers],
    )


def kv_export_from_proto(msg: worker_pb2.KVExport) -> KVExport:
    return KVExport(
        kind=msg.kind,
        export_id=msg.export_id,
        host_id=msg.host_id,
        dtype=msg.dtype,
        num_layers=msg.num_layers,
        layer_shape=list(msg.layer_shape),
        shm_name=msg.shm_name,
        layers=[CudaIpcHandle(**{n: getattr(h, n) for n in _IPC_FIELDS}) for h in msg.layers],
    )


def peer_copy_to_proto(c: PeerCopy) -> worker_pb2.PeerCopy:
    return worker_pb2.PeerCopy(
        seq_id=c.seq_id,
        source=kv_export_to_proto(c.source),
        src_block_ids=c.src_block_ids,
        dst_block_ids=c.dst_block_ids,
    )


def peer_copy_from_proto(msg: worker_pb2.PeerCopy) -> PeerCopy:
    source = kv_export_from_proto(msg.source)
    return PeerCopy(msg.seq_id, source, list(msg.src_block_ids), list(msg.dst_block_ids))
