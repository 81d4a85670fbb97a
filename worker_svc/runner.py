"""The model runner: executes step plans against the model and the paged KV cache.

Stateful by design (ARCHITECTURE principle 3): it keeps every running sequence's tokens, block
table and sampling parameters, so a plan only says what changed.

Per step the host work is vectorised: each sequence holds a row of a host block table (numpy)
that is filled as blocks arrive, positions and slots come from numpy over the whole batch, and
all integer inputs reach the device in one non-blocking copy. On CUDA with the Triton backend
pure-decode steps replay CUDA graphs (`worker_svc.cuda_graphs`); the only host sync of a step is
the sampler's copy of the sampled ids.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.attention_metadata import AttentionMetadata
from services.kv_mac import KVMac
from services.mesh_secret import client_key
from services.model_files import default_cache_dir, load_tokenizer, resolve_model
from services.sampling_params import SamplingParams
from services.step import NewSequence, StepPlan, StepResult, TokenLogprobs, WorkerInfo
from worker_svc.config import WorkerConfig, default_batch_limits
from worker_svc.decode_gemms import choose_decode_gemms
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_cache
from worker_svc.kv_shards import KVShardExchange
from worker_svc.kv_tiers import KVStoreLink, WorkerKVTiers
from worker_svc.loader import load_model, model_fingerprint
from worker_svc.parallel import TensorParallel
from worker_svc.rank_channel import ForwardInputs
from worker_svc.rank_group import RankGroup, start_rank_group
from worker_svc.sampler import SampledIds, Sampler, SamplingRow
from worker_svc.spec_decode.config import SpeculativeConfig
from worker_svc.spec_decode.draft_model import DraftModel
from worker_svc.spec_decode.ngram import NgramProposer
from worker_svc.structured import SequenceGrammar, StructuredOutputManager

log = logging.getLogger(__name__)


# A step thread and an event-loop thread pass the GIL back and forth every step (the loop
# plans step N+1 while the step thread waits on the GPU). CPython lets a thread keep the GIL
# for up to 5 ms before a waiting one gets it, which is longer than a small model's whole
# step: a thread that finished waiting on the GPU would sit idle behind the planner.
GIL_SWITCH_INTERVAL_S = 0.0002


def shorten_gil_switch_interval() -> None:
    """Let a step thread get the GIL back within ~0.2 ms (a process-wide setting, never raised)."""
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))


@dataclass
class SequenceState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    seq_id: str = ""
    row: int = -1  # this sequence's row of the runner's host block table
    sampling_row: SamplingRow | None = None  # cached (live views) when no penalty needs copies
    # A step launched but not finished samples this sequence's next token: it is on the device
    # (row `inflight_row` of that step's sampled ids), not yet in token_ids.
    inflight: LaunchedStep | None = None
    inflight_row: int = -1
    # Speculative decoding: tokens proposed after the last sampled one (the next plan may verify
    # some), and how many the current plan asks for after its sample.
    drafts: list[int] = field(default_factory=list)
    draft_start: int = 0  # len(token_ids) when `drafts` were proposed: drafts[0] is for that position
    max_draft_tokens: int = 0
    promised_drafts: int = 0  # a draft model's drafts, reported but made when verified
    grammar: SequenceGrammar | None = None  # structured outputs: this sequence's matcher


@dataclass
class LaunchedStep:
    """A step whose GPU work is queued; `ModelRunner.finish` reads its sampled ids."""

    result: StepResult
    sampling: list[SequenceState]
    sampled: SampledIds | None = None
    # Speculative decoding, per sampling sequence: the drafts this step verifies (None: no
    # sequence verifies any) and how many tokens to propose once its id is known.
    verified: list[list[int]] | None = None
    propose: list[int] = field(default_factory=list)


class _TokenSpan(Sequence[int]):
    """A live, copy-free view of `tokens[start:]` (the output tokens of a growing sequence)."""

    __slots__ = ("_start", "_tokens")

    def __init__(self, tokens: list[int], start: int) -> None:
        self._tokens = tokens
        self._start = start

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        return self._tokens[self._start :][i]

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens[self._start :])


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


class _BlockTableRows:
    """One row per live sequence of a host int32 block table, filled incrementally."""

    def __init__(self, width: int, rows: int = 64) -> None:
        self.table = np.zeros((rows, width), dtype=np.int32)
        self.lens = np.zeros(rows, dtype=np.int64)
        self.free = list(range(rows - 1, -1, -1))

    def alloc(self, block_ids: list[int]) -> int:
        if not self.free:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
            self.free = list(range(2 * old - 1, old - 1, -1))
        row = self.free.pop()
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.lens[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            grown = np.zeros(
                (self.table.shape[0], _round16(max(end, 2 * self.table.shape[1]))), dtype=np.int32
            )
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown
        self.table[row, start:end] = block_ids
        self.lens[row] = end

    def release(self, row: int) -> None:
        # Zero the row so that a later occupant's unread tail holds valid block ids (0).
        self.table[row, : int(self.lens[row])] = 0
        self.lens[row] = 0
        self.free.append(row)

    def clear(self) -> None:
        self.table[:] = 0
        self.lens[:] = 0
        self.free = list(range(self.table.shape[0] - 1, -1, -1))


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
_ALIGN = 64  # bytes: Triton specialises pointer arguments on 16-byte alignment


def pack_to_device(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """`arrays` (int32/int64) as views into one device buffer filled by a single copy.

    The copy is non-blocking from pageable memory: the driver stages the bytes before returning
    and waits for no queued kernel, so the host buffer may be dropped at once. Each array starts
    on a 64-byte boundary, so its pointer alignment (which Triton specialises on) never varies.
    """
    offsets = []
    total = 0
    for a in arrays:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += a.nbytes
    blob = np.empty(max(total, _ALIGN), dtype=np.uint8)
    for a, off in zip(arrays, offsets, strict=True):
        blob[off : off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    dev = torch.from_numpy(blob).to(device, non_blocking=True)
    return [
        dev[off : off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
        for a, off in zip(arrays, offsets, strict=True)
    ]


def _patch_where(from_device: list[tuple[int, int]]) -> np.ndarray:
    """The input positions whose token the previous step sampled on the device (for the other ranks)."""
    return np.asarray([i for i, _ in from_device], dtype=np.int64)


def make_backend(name: str, device: torch.device):
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from worker_svc.attention.torch_paged import TorchPagedBackend

        return TorchPagedBackend()
    if name == "triton":
        from worker_svc.attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend()
    raise ValueError(f"attention_backend must be auto, torch or triton; got {name!r}")


class ModelRunner:
    def __init__(
        self,
        config: WorkerConfig,
        kv_store: KVStoreLink | None = None,
        on_rank_failure: Callable[[str], None] | None = None,
    ) -> None:
        """`on_rank_failure(why)`: called (on a watcher thread) when a tensor-parallel rank dies."""
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        self.model_path = resolve_model(config.model, config.cache_dir)
        self.backend = make_backend(config.attention_backend, self.device)
        # Tensor parallelism: this process is rank 0; the others start here (None at size 1).
        self.ranks: RankGroup | None = start_rank_group(config, self.model_path, on_rank_failure)
        self.tp = self.ranks.tp if self.ranks is not None else TensorParallel()
        try:
            self._build(config, kv_store)
        except BaseException:
            self.close()
            raise

    def _build(self, config: WorkerConfig, kv_store: KVStoreLink | None) -> None:
        if config.decode_gemm not in ("auto", "cublas"):
            raise ValueError(f"decode_gemm must be auto or cublas, got {config.decode_gemm!r}")
        self.model, self.model_config = load_model(
            self.model_path,
            dtype=self.dtype,
            device=self.device,
            backend=self.backend,
            load_format=config.load_format,
            tp=self.tp,
        )
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        bs = config.block_size
        spec = KVCacheSpec.of(mc, bs, self.dtype, self.tp.size)
        self.spec = SpeculativeConfig.parse(config.speculative_config)
        self.draft = DraftModel(self.spec, self) if self.spec and self.spec.method == "draft_model" else None
        # A draft model's KV cache has a block for each of the target's: they share the budget.
        per_block = spec.bytes_per_block + (self.draft.kv_spec.bytes_per_block if self.draft else 0)
        num_kv_blocks = config.num_kv_blocks or max(self._kv_budget(spec) // per_block, 0)
        # Every rank holds its heads' share of every block: the count is the least any rank holds.
        self.num_kv_blocks = self.tp.min_int(num_kv_blocks, self.device)
        if self.num_kv_blocks < 1:
            raise ValueError("the KV cache budget holds no block; raise kv_cache_memory")
        self.kv_caches = allocate_kv_cache(spec, self.num_kv_blocks, self.device)
        if self.draft is not None:
            self.draft.allocate(self.num_kv_blocks, self.device)
        # Blocks are only interchangeable between workers with the same weights and cache layout.
        # The tiers hold whole blocks in size 1's layout whatever the tensor-parallel size (the
        # ranks' heads joined in order), so workers of every size share the store's chunks.
        layout = f"{config.block_size}:{self.dtype}:{mc.num_layers}:{mc.num_kv_heads}:{mc.head_dim}"
        self.fingerprint = hashlib.sha256(model_fingerprint(self.model_path) + layout.encode()).digest()
        if kv_store is not None and (config.kv_chunk_tokens < bs or config.kv_chunk_tokens % bs):
            raise ValueError(f"kv_chunk_tokens {config.kv_chunk_tokens} is not a multiple of block_size {bs}")
        whole = KVCacheSpec.of(mc, bs, self.dtype)
        self.kv_tiers = WorkerKVTiers(
            self.kv_caches,
            whole,
            self.fingerprint,
            num_host_blocks=config.kv_offload_bytes // whole.bytes_per_block,
            store=kv_store,
            chunk_blocks=config.kv_chunk_tokens // bs,
            shards=self._kv_shards(),
            put_bytes=config.kv_store_put_bytes,
            mac=self._kv_mac(config) if kv_store is not None else None,
        )
        self.sampler = Sampler(mc.vocab_size, self.device, seed=config.seed)
        self.proposer = self._make_proposer(self.spec)
        # Grammar matchers of constrained sequences (the tokenizer is loaded on first use).
        self.structured = StructuredOutputManager(
            lambda: load_tokenizer(self.model_path), mc.vocab_size, mc.eos_token_ids
        )
        self.seqs: dict[str, SequenceState] = {}
        # Block-table widths are kept multiples of 16: Triton specialises integer arguments (the
        # table's row stride among them) on divisibility by 16, so varying widths would compile
        # new kernel variants mid-run.
        self.max_blocks_per_seq = _round16((self.max_model_len + bs - 1) // bs)
        self.max_num_seqs = config.resolved_max_num_seqs()
        # vLLM's token budget for this device: a suggestion to schedulers that set none (WorkerInfo).
        self.suggested_batched_tokens = default_batch_limits(self.device)[1]
        self._tables = _BlockTableRows(self.max_blocks_per_seq, rows=self.max_num_seqs)
        self._eos = list(mc.eos_token_ids)
        self._graphs = None
        if self.device.type == "cuda" and self.backend.name == "triton" and not config.enforce_eager:
            from worker_svc.cuda_graphs import DecodeGraphs, capture_sizes

            if config.decode_gemm == "auto":
                models = [self.model] + ([self.draft.model] if self.draft else [])
                choose_decode_gemms(models, self.device, config.cache_dir or default_cache_dir())
            self._graphs = DecodeGraphs(self, capture_sizes(self.max_num_seqs))
            self._graphs.capture()
        # Verification steps (speculative decoding) replay graphs of 1 + num_speculative_tokens
        # query rows per sequence: eager, a small model's verification costs several decode steps.
        self._verify_graphs = None
        if self._graphs is not None and self.spec is not None and self.tp.size == 1:
            self._verify_graphs = DecodeGraphs(
                self, capture_sizes(self.max_num_seqs), query_len=1 + self.spec.num_speculative_tokens
            )
            self._verify_graphs.capture()
        log.info("model runner ready", extra={"blocks": self.num_kv_blocks, "device": str(self.device)})

    @staticmethod
    def _kv_mac(config) -> KVMac:
        """Store entries are signed and checked with the mesh secret (a service's resolved key;
        offline, the one a client told nothing carries): the store and Redis are untrusted."""
        return KVMac(getattr(config, "internal_key", None) or client_key())

    def _kv_shards(self) -> KVShardExchange | None:
        """With tensor parallelism, how the tiers reach the other ranks' heads of each block."""
        if self.ranks is None:
            return None
        ranks = self.ranks
        return KVShardExchange(self.tp, lambda kind, block_ids: ranks.announce(kind, [block_ids]))

    def _kv_budget(self, spec: KVCacheSpec) -> int:
        if self.device.type != "cuda":
            return self.config.kv_cache_memory
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = total * (1.0 - self.config.gpu_memory_utilization)
        # Leave room for activations of the largest batch (a generous fixed margin).
        return int(max(free - reserve - (1 << 30), 0))

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do at size 1)."""
        if self.ranks is not None:
            self.ranks.close()

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(
            model_name=self.config.model or "SmolLM2-135M-Instruct",
            fingerprint=self.fingerprint,
            block_size=self.config.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.model_config.eos_token_ids),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.suggested_batched_tokens,
            num_host_blocks=self.kv_tiers.num_host_blocks,
            kv_chunk_blocks=self.kv_tiers.chunk_blocks,
            num_speculative_tokens=self.spec.num_speculative_tokens if self.spec else 0,
            spec_disable_by_batch_size=self.spec.disable_by_batch_size if self.spec else 0,
            spec_drafts_ahead=self.proposer is not None,
        )

    @staticmethod
    def _make_proposer(spec: SpeculativeConfig | None) -> NgramProposer | None:
        if spec is None or spec.method != "ngram":
            return None  # none, or a draft model (self.draft)
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)

    @property
    def block_table(self) -> np.ndarray:
        """The host block table: row `SequenceState.row` holds that sequence's block ids."""
        return self._tables.table

    # ----- state -----
    def _apply(self, plan: StepPlan) -> list[tuple[SequenceState, int]]:
        for seq_id in plan.finished_ids + plan.preempted_ids:
            self._drop(seq_id)
        order: list[tuple[SequenceState, int]] = []
        for new in plan.new_seqs:
            self._drop(new.seq_id)
            st = self._state_of(new)
            st.row = self._tables.alloc(st.block_ids)
            st.max_draft_tokens = new.max_draft_tokens
            spec = st.params.structured_outputs
            if spec is not None:  # compiles while the prompt is prefilled
                st.grammar = self.structured.start(spec, st.token_ids[st.num_prompt_tokens :])
            self.seqs[new.seq_id] = st
            order.append((st, new.num_new_tokens))
        for s in plan.scheduled:
            st = self.seqs.get(s.seq_id)
            if st is None:
                raise KeyError(f"plan schedules unknown sequence {s.seq_id!r}")
            if s.new_block_ids:
                st.block_ids.extend(s.new_block_ids)
                self._tables.append(st.row, s.new_block_ids)
            st.max_draft_tokens = s.max_draft_tokens
            order.append((st, s.num_new_tokens))
        return order

    def _transfer(
        self, plan: StepPlan, order: list[tuple[SequenceState, int]], result: StepResult
    ) -> list[tuple[SequenceState, int]]:
        """Do the plan's KV moves; a sequence whose store chunks could not be had computes them now."""
        refused = self.kv_tiers.verify_failures
        failed = self.kv_tiers.apply(plan.kv, lambda seq_id, block: self.seqs[seq_id].block_ids.index(block))
        if not failed:
            return order
        result.kv_verify_failures = self.kv_tiers.verify_failures - refused
        result.failed_load_seq_ids = list(failed)
        bs = self.config.block_size
        redone = []
        for st, num_new in order:
            first_block = failed.get(st.seq_id)
            if first_block is not None and first_block * bs < st.num_computed_tokens:
                num_new += st.num_computed_tokens - first_block * bs
                st.num_computed_tokens = first_block * bs
            redone.append((st, num_new))
        return redone

    def _drop(self, seq_id: str) -> None:
        st = self.seqs.pop(seq_id, None)
        if st is not None and st.row >= 0:
            self._tables.release(st.row)
        if self.proposer is not None:
            self.proposer.forget(seq_id)

    @staticmethod
    def _state_of(new: NewSequence) -> SequenceState:
        return SequenceState(
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            params=new.sampling_params,
            seq_id=new.seq_id,
        )

    def drop_all(self) -> None:
        self.seqs.clear()
        self._tables.clear()
        if self.proposer is not None:
            self.proposer.forget_all()

    # ----- host -> device -----
    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Tensors on the runner's device equal to `arrays` (int32/int64 numpy).

        On CPU they share the arrays' memory; on CUDA they arrive in one non-blocking copy.
        """
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        return pack_to_device(arrays, self.device)

    # ----- execution -----
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan to the end (its sampled ids read back)."""
        return self.finish(self.launch(plan))

    def can_follow(self, plan: StepPlan) -> bool:
        """Whether `plan` may be launched while the step before it is still unfinished.

        The next token of a sequence in flight is known only on the device. It can be fed to
        the forward from there, but a sampler that reads the output so far (penalties, a
        seed's per-position draw, min_tokens) needs it on the host first, and so does a grammar:
        its next token mask exists only once the matcher has accepted the token in flight.
        """
        for s in plan.scheduled:
            st = self.seqs.get(s.seq_id)
            if st is not None and st.inflight is not None:
                verified = st.inflight.verified
                if verified is not None and verified[st.inflight_row]:
                    return False  # a verification's result on the device is not a next input
                if s.num_new_tokens > 1 and self.draft is not None:
                    return False  # a draft model drafts from the last token, on the host
                p = st.params
                if _uses_penalties(p) or p.seed is not None or p.min_tokens > 0 or st.grammar is not None:
                    return False
        return True

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue a plan's forward and sampling; a sequence's token still in flight is read on the device."""
        order = self._apply(plan)
        result = StepResult(step_id=plan.step_id)
        if plan.kv:
            order = self._transfer(plan, order, result)
        # A host load runs beside the forward, layer by layer: an eager forward waits per layer,
        # anything else for the whole load.
        loading = self.kv_tiers.take_layer_events()
        launched = LaunchedStep(result, [])
        if not order:
            self.kv_tiers.wait_for_loads(loading)
            return launched
        if self.draft is not None:
            self._draft_now(order)
        bs = self.config.block_size
        n = len(order)
        starts = np.empty(n, dtype=np.int64)
        query_lens = np.empty(n, dtype=np.int64)
        rows = np.empty(n, dtype=np.int64)
        input_ids: list[int] = []
        sample_rows: list[int] = []  # index in the batch of the sequences that sample
        sampling: list[SequenceState] = []
        verified: list[list[int]] = []  # per sampling sequence: the drafts it verifies
        outputs_before: list[int] = []  # per sampling sequence: its output tokens before this step
        propose: list[int] = []
        # (index in input_ids, row of the previous step's sampled ids) for tokens still in flight.
        from_device: list[tuple[int, int]] = []
        prev: SampledIds | None = None
        pure_decode = True
        for i, (st, num_new) in enumerate(order):
            start = st.num_computed_tokens
            end = start + num_new
            known = len(st.token_ids)
            inflight = st.inflight is not None
            base = known + inflight  # its tokens, the one still on the device included
            drafts: list[int] = []
            if end > base:  # past its tokens: verify drafts (proposed perhaps a token before)
                skip, want = base - st.draft_start, end - base
                drafts = st.drafts[skip : skip + want] if skip >= 0 else []
                if len(drafts) < want:
                    # A later proposal replaced the drafts the plan counted (they were made while
                    # a step was in flight): fill up. Any token is a valid draft, only likelier
                    # to be rejected; the output stays exactly the model's.
                    drafts += [drafts[-1] if drafts else st.token_ids[-1]] * (want - len(drafts))
            total = base + len(drafts)
            if end > total or end > len(st.block_ids) * bs or (drafts and start >= base):
                raise ValueError(f"sequence {st.seq_id!r}: {end} tokens exceed its tokens or blocks")
            starts[i] = start
            query_lens[i] = num_new
            rows[i] = st.row
            if num_new != 1:
                pure_decode = False
            input_ids.extend(st.token_ids[start:min(end, known)])
            if inflight and end > known:  # an input is the token the unfinished step samples
                assert st.inflight is not None and st.inflight.sampled is not None
                prev = st.inflight.sampled
                from_device.append((len(input_ids), st.inflight_row))
                input_ids.append(0)
            input_ids.extend(drafts)
            if end == total:
                st.inflight, st.inflight_row = launched, len(sampling)
                sample_rows.append(i)
                sampling.append(st)
                verified.append(drafts)
                outputs_before.append(base - st.num_prompt_tokens)
                propose.append(min(st.max_draft_tokens, self.spec.num_speculative_tokens) if self.spec else 0)
        launched.sampling = sampling
        launched.propose = propose
        num_verified = sum(len(d) for d in verified)
        if num_verified:
            launched.verified = verified
            pure_decode = False
        seq_lens = starts + query_lens
        max_seq_len = int(seq_lens.max())
        table = self._tables.table
        width = min(_round16((max_seq_len + bs - 1) // bs), table.shape[1])
        tables = table[rows, :width]  # fancy indexing: a fresh contiguous copy
        ids = np.asarray(input_ids, dtype=np.int64)
        if pure_decode:
            positions = starts
            token_rows = rows
        else:
            qsl = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(query_lens, out=qsl[1:])
            num_tokens = int(qsl[-1])
            positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - qsl[:-1], query_lens)
            token_rows = np.repeat(rows, query_lens)
        slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        if not pure_decode:
            last = qsl[1:][sample_rows] - 1 if sample_rows else np.zeros(0, dtype=np.int64)
            if num_verified:  # a verifying sequence samples at each draft's position too
                per_seq = np.asarray([len(d) + 1 for d in verified], dtype=np.int64)
                first = np.cumsum(per_seq) - per_seq
                offsets = np.arange(int(per_seq.sum()), dtype=np.int64) - np.repeat(first, per_seq)
                last = np.repeat(last + 1 - per_seq, per_seq) + offsets
        # A verification whose sequences all sample replays the verify graphs: token i of the
        # step becomes row to_padded[i] of q rows per sequence.
        vgraphs = self._verify_graphs
        to_padded = None
        if num_verified and vgraphs is not None and len(sampling) == n and n <= vgraphs.max_size:
            q = vgraphs.q
            if int(query_lens.max()) <= q:
                # Context = seq_len - q: the rows past a sequence's end are padding.
                p_seq_lens = (starts + q).astype(np.int32)
                p_width = min(_round16((int(p_seq_lens.max()) + bs - 1) // bs), table.shape[1])
                if p_width <= vgraphs.width:
                    grid = (np.arange(n, dtype=np.int64) * q)[:, None] + np.arange(q)[None, :]
                    to_padded = grid[np.arange(q)[None, :] < query_lens[:, None]]
        patch = None
        if from_device:
            assert prev is not None
            moves = np.asarray(from_device, dtype=np.int64).T.copy()
            if to_padded is not None:
                moves[0] = to_padded[moves[0]]
            where = self.upload([moves])[0]
            patch = (where[0], prev.sampled.index_select(0, where[1]).to(torch.int64))

        graphs = self._graphs
        use_graph = pure_decode and graphs is not None and n <= graphs.max_size and width <= graphs.width
        if use_graph or to_padded is not None:  # a graph replay waits for the whole load
            self.kv_tiers.wait_for_loads(loading)
        if use_graph:
            all_sample = len(sample_rows) == n
            last_rows = None if all_sample else np.asarray(sample_rows, dtype=np.int64)
            if self.ranks is not None:  # the other ranks run the same forward on their shards
                self.ranks.send(
                    ForwardInputs(True, ids, positions, slots, seq_lens.astype(np.int32), tables,
                                  len(sampling), last_rows, patch_where=_patch_where(from_device)),
                    patch,
                )  # fmt: skip
            hidden = graphs.run(ids, positions, slots, seq_lens.astype(np.int32), tables, patch)
            sample_index = None if all_sample else self.upload([last_rows])[0]
        elif to_padded is not None:
            assert vgraphs is not None
            q = vgraphs.q
            p_ids = np.zeros(n * q, dtype=np.int64)
            p_ids[to_padded] = ids
            p_slots = np.full(n * q, -1, dtype=np.int64)  # padding rows write no KV
            p_slots[to_padded] = slots
            # Padding rows' positions only need to stay inside the rotary table.
            p_pos = np.minimum(starts[:, None] + np.arange(q)[None, :], self.max_model_len - 1).reshape(-1)
            hidden = vgraphs.run(p_ids, p_pos, p_slots, p_seq_lens, table[rows, :p_width], patch)
            sample_index = self.upload([to_padded[last]])[0]
        else:
            if pure_decode:
                qsl = np.arange(n + 1, dtype=np.int64)
                last = qsl[1:][sample_rows] - 1 if sample_rows else np.zeros(0, dtype=np.int64)
            all_sample = pure_decode and len(sample_rows) == n
            if self.ranks is not None:  # the other ranks run the same forward on their shards
                self.ranks.send(
                    ForwardInputs(False, ids, positions, slots, seq_lens.astype(np.int32), tables,
                                  len(sampling), None if all_sample else last, qsl.astype(np.int32),
                                  query_lens, int(query_lens.max()), max_seq_len, _patch_where(from_device)),
                    patch,
                )  # fmt: skip
            d_ids, d_pos, d_slots, d_last, d_qsl, d_lens, d_tables = self.upload(
                [ids, positions, slots, last, qsl.astype(np.int32), seq_lens.astype(np.int32), tables]
            )
            if patch is not None:
                d_ids.index_copy_(0, *patch)
            meta = AttentionMetadata(
                slot_mapping=d_slots,
                query_start_loc=d_qsl,
                seq_lens=d_lens,
                block_tables=d_tables,
                max_query_len=int(query_lens.max()),
                max_seq_len=max_seq_len,
                query_lens_cpu=query_lens.tolist(),
                seq_lens_cpu=seq_lens.tolist(),
                layer_ready=loading,
            )
            hidden = self.model(d_ids, d_pos, self.kv_caches, meta)
            self.kv_tiers.wait_for_loads(loading)
            if self.draft is not None:
                self.draft.forward_alongside(d_ids, d_pos, meta)
            sample_index = None if all_sample else d_last
        for st, num_new in order:
            st.num_computed_tokens += num_new
        if not sampling:
            return launched
        picked = hidden if sample_index is None else hidden[sample_index]
        logits = self.model.compute_logits(picked)
        bitmask = self.structured.bitmask([st.grammar for st in sampling])
        if num_verified:
            rows = [
                r
                for st, d, n_out in zip(sampling, verified, outputs_before, strict=True)
                for r in self._verify_rows(st, d, n_out)
            ]
            if bitmask is not None:  # one row per position; drafting sequences are unconstrained
                bitmask = bitmask.repeat_interleave(torch.tensor([len(d) + 1 for d in verified]), dim=0)
            launched.sampled = self.sampler.verify_async(logits, rows, verified, bitmask)
        else:
            sampling_rows = [self._sampling_row(st) for st in sampling]
            launched.sampled = self.sampler.sample_async(logits, sampling_rows, bitmask)
        return launched

    def finish(self, launched: LaunchedStep) -> StepResult:
        """Read a launched step's sampled ids (waiting for the device) and append them."""
        result = launched.result
        if launched.sampled is None:
            return result
        token_ids, logprobs = launched.sampled.wait()
        for st, token_id in zip(launched.sampling, token_ids, strict=True):
            st.token_ids.append(token_id)
            if st.grammar is not None:
                st.grammar.accept(token_id)
            if st.inflight is launched:
                st.inflight = None
        if launched.verified is None:
            result.seq_ids = [st.seq_id for st in launched.sampling]
            result.token_ids, result.logprobs = token_ids, logprobs
        else:
            self._accept_drafts(launched, token_ids, logprobs)
        if any(launched.propose):
            self._propose(launched)
        return result

    def _accept_drafts(
        self, launched: LaunchedStep, token_ids: list[int], logprobs: list[TokenLogprobs | None]
    ) -> None:
        """A verifying step's result: each sequence gains its accepted drafts, then its sampled id."""
        assert launched.sampled is not None and launched.verified is not None
        accepted = launched.sampled.num_accepted
        assert accepted is not None
        result = launched.result
        for st, drafts, a, token_id, lp in zip(
            launched.sampling, launched.verified, accepted, token_ids, logprobs, strict=True
        ):
            if drafts:
                # The sampled id is already appended: slot the accepted drafts in before it. KV
                # written for rejected drafts lies past the new length and is overwritten later.
                st.token_ids[-1:-1] = drafts[:a]
                st.num_computed_tokens = len(st.token_ids) - 1
                result.seq_ids.extend([st.seq_id] * (a + 1))
                result.token_ids.extend([*drafts[:a], token_id])
                result.logprobs.extend([None] * (a + 1))
            else:
                result.seq_ids.append(st.seq_id)
                result.token_ids.append(token_id)
                result.logprobs.append(lp)

    def _propose(self, launched: LaunchedStep) -> None:
        """Draft tokens for the sequences that asked, now that their last token is known."""
        result = launched.result
        for st, k in zip(launched.sampling, launched.propose, strict=True):
            if k <= 0 or self.seqs.get(st.seq_id) is not st:
                continue  # dropped meanwhile
            if self.draft is not None:
                if st.inflight is not None:
                    continue  # a later step samples it already: a draft model needs its last token
                st.promised_drafts = num = k  # made by the plan that verifies them (`_draft_now`)
            else:
                assert self.proposer is not None
                # With a later step in flight these drafts start a token early; the plan that
                # verifies them skips the first (`draft_start`), which is a guess all the same.
                st.drafts = self.proposer.propose(st.seq_id, st.token_ids, k)
                st.draft_start = len(st.token_ids)
                num = len(st.drafts)
            if num:
                result.draft_seq_ids.append(st.seq_id)
                result.num_draft_tokens.append(num)

    def _draft_now(self, order: list[tuple[SequenceState, int]]) -> None:
        """A draft model's promised drafts, for the sequences this plan verifies them for."""
        seqs, ks = [], []
        for st, num_new in order:
            if st.promised_drafts and st.inflight is None:
                used = st.num_computed_tokens + num_new - len(st.token_ids)
                if used > 0:
                    seqs.append(st)
                    ks.append(min(used, st.promised_drafts))
            st.promised_drafts = 0
        if seqs:
            assert self.draft is not None
            for st, drafts in zip(seqs, self.draft.propose(self, seqs, ks), strict=True):
                st.drafts, st.draft_start = drafts, len(st.token_ids)

    def _verify_rows(self, st: SequenceState, drafts: list[int], num_out: int) -> list[SamplingRow]:
        """Sampling rows of a sequence at its last token and at each draft: the output so far there.

        `num_out` counts its output tokens before this step, one still on the device included
        (then its params need no output on the host: `can_follow`).
        """
        if not drafts:
            return [self._sampling_row(st)]
        if _uses_penalties(st.params):
            prompt, out = st.token_ids[: st.num_prompt_tokens], st.token_ids[st.num_prompt_tokens :]
            outputs: list = [out + drafts[:j] for j in range(len(drafts) + 1)]
        else:  # only the count of output tokens matters (min_tokens, a seed's per-position draw)
            prompt, outputs = [], [range(num_out + j) for j in range(len(drafts) + 1)]
        return [SamplingRow(st.params, prompt, o, self._eos) for o in outputs]

    def _sampling_row(self, st: SequenceState) -> SamplingRow:
        if st.sampling_row is not None:
            return st.sampling_row
        if _uses_penalties(st.params):
            # Penalties read every token: plain list copies, made only for these rows.
            return SamplingRow(
                params=st.params,
                prompt_token_ids=st.token_ids[: st.num_prompt_tokens],
                output_token_ids=st.token_ids[st.num_prompt_tokens :],
                eos_token_ids=self._eos,
            )
        # Otherwise the sampler needs only the number of output tokens: a live view, made once.
        st.sampling_row = SamplingRow(
            params=st.params,
            prompt_token_ids=[],
            output_token_ids=_TokenSpan(st.token_ids, st.num_prompt_tokens),  # type: ignore[arg-type]
            eos_token_ids=self._eos,
        )
        return st.sampling_row
