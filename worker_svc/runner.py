"""The model runner: executes step plans against the model and the paged KV cache.

Stateful by design (ARCHITECTURE principle 3): it keeps every running sequence's tokens, block
table and sampling parameters, so a plan only says what changed.

A step is: apply the plan to that state, prepare the forward's inputs on the host
(`worker_svc.step_inputs`, numpy over the whole batch), give them to the other tensor-parallel
ranks, run the forward (`worker_svc.executor.ModelExecutor`, which every rank owns alike: all
integer inputs reach the device in one non-blocking copy, and on CUDA with the Triton backend
pure decodes replay CUDA graphs), then queue the sampling. The only host sync of a step is the
sampler's copy of the sampled ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from services.kv_mac import KVMac
from services.mesh_secret import client_key
from services.model_files import load_tokenizer, resolve_model
from services.sampling_params import SamplingParams
from services.step import NewSequence, StepPlan, StepResult, TokenLogprobs, WorkerInfo
from worker_svc.config import WorkerConfig, default_batch_limits
from worker_svc.device_memory import ExecutorSleep, free_cached_memory, release
from worker_svc.executor import ModelExecutor, Patch
from worker_svc.kv_cache import ByteViews, KVCacheSpec
from worker_svc.kv_peer import PeerCopier, export_caches, import_kind
from worker_svc.kv_scales import describe as describe_kv_scales
from worker_svc.kv_shards import KVShardExchange
from worker_svc.kv_tiers import KVStoreLink, WorkerKVTiers
from worker_svc.loader import model_fingerprint
from worker_svc.lora.slots import encode_lora_load
from worker_svc.parallel import TensorParallel
from worker_svc.pooling import Pooler, default_pooling, drop_pooling_samples, pooled_outputs
from worker_svc.prompt_logprobs import PromptLogprobsPending, PromptRows, prompt_rows
from worker_svc.rank_channel import EAGER, LORA_LOAD, ForwardInputs
from worker_svc.rank_group import RankGroup, start_rank_group
from worker_svc.sampler import SampledIds, Sampler, SamplingRow, uses_penalties
from worker_svc.spec_decode.config import SpeculativeConfig
from worker_svc.spec_decode.ngram import NgramProposer
from worker_svc.step_inputs import BlockTableRows, prepare_step
from worker_svc.structured import MaskFill, SequenceGrammar, StructuredOutputManager

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
    lora_slot: int = -1  # its LoRA adapter's slot (worker_svc/lora/slots.py); -1: the base model


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
    prompt: PromptLogprobsPending | None = None  # prompt logprobs this step computes
    pooled: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # prompts pooled (embeddings)
    # Structured outputs, one step behind: a step launched while the one before it was in flight
    # queues its forward at once, and its sampling (a call taking the masks) once the step before has been
    # finished, whose tokens its rows' grammars must accept first (`then_sample` of that step).
    deferred: Callable[[torch.Tensor | None], SampledIds] | None = None  # bitmask -> sampled ids
    then_sample: LaunchedStep | None = None
    masks: MaskFill | None = None  # the deferred sampling's masks, being filled (`sample_deferred`)


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


class ModelRunner:
    """Rank 0 of a worker: the sequences' state, input preparation and sampling around a
    `ModelExecutor` (the model side, which every other tensor-parallel rank runs alike)."""

    def __init__(
        self,
        config: WorkerConfig,
        kv_store: KVStoreLink | None = None,
        on_rank_failure: Callable[[str], None] | None = None,
    ) -> None:
        """`on_rank_failure(why)`: called (on a watcher thread) when a tensor-parallel rank dies."""
        self.config = config
        self.device = config.torch_device()
        self.bind_thread()  # this constructor runs on a thread of asyncio.to_thread's pool
        self.dtype = config.torch_dtype()
        self.model_path = resolve_model(config.model, config.cache_dir)
        # Tensor parallelism: this process is rank 0; the others start here (None at size 1).
        self.ranks: RankGroup | None = start_rank_group(config, self.model_path, on_rank_failure)
        self.tp = self.ranks.tp if self.ranks is not None else TensorParallel()
        try:
            self._build(config, kv_store)
        except BaseException:
            self.close()
            raise

    def bind_thread(self) -> None:
        """Make this worker's GPU the calling thread's current device. CUDA's current device is
        per thread and starts at 0, and Triton launches on the current device, so a worker on
        `cuda:1` failed its first forward ("Pointer argument cannot be accessed from Triton")
        unless every thread that launches kernels (this constructor's, the step thread) binds."""
        if self.device.type == "cuda" and self.device.index is not None:  # plain "cuda": the current one
            torch.cuda.set_device(self.device)

    def _build(self, config: WorkerConfig, kv_store: KVStoreLink | None) -> None:
        ex = self.executor = ModelExecutor(config, self.tp, self.model_path)
        if ex.lora is not None and self.ranks is not None:  # each rank loads its shard of an adapter
            ranks = self.ranks
            ex.lora.on_load = lambda slot, path: ranks.announce(LORA_LOAD, encode_lora_load(slot, path))
        # The executor's, under the names the worker's other parts (and benchmarks) read.
        self.model, self.model_config, self.backend = ex.model, ex.model_config, ex.backend
        self.spec, self.draft = ex.spec, ex.draft
        self.max_model_len, self.max_blocks_per_seq = ex.max_model_len, ex.max_blocks_per_seq
        self.num_kv_blocks, self.kv_caches = ex.num_kv_blocks, ex.kv_caches
        mc = self.model_config
        bs = config.block_size
        # Blocks are only interchangeable between workers with the same weights and cache layout.
        # The tiers hold whole blocks in size 1's layout whatever the tensor-parallel size (the
        # ranks' heads joined in order), so workers of every size share the store's chunks.
        layout = f"{config.block_size}:{self.dtype}:{mc.num_layers}:{mc.num_kv_heads}:{mc.head_dim}"
        if config.quantization:  # other weights, other KV values: never shared with the model's dtype
            layout += f":{config.quantization}"
        if ex.kv_scale_exponents is not None:  # e4m3 codes, meaningful only with their scales
            layout += f":kv=fp8_e4m3:{describe_kv_scales(ex.kv_scale_exponents)}"
        self.fingerprint = hashlib.sha256(model_fingerprint(self.model_path) + layout.encode()).digest()
        if kv_store is not None and (config.kv_chunk_tokens < bs or config.kv_chunk_tokens % bs):
            raise ValueError(f"kv_chunk_tokens {config.kv_chunk_tokens} is not a multiple of block_size {bs}")
        whole = KVCacheSpec.of(mc, bs, ex.kv_cache_dtype)
        tier_caches = self.kv_caches
        if ex.kv_scale_exponents is not None:  # the tiers move an fp8 cache's blocks as bytes
            whole, tier_caches = dataclasses.replace(whole, dtype=torch.uint8), ByteViews(self.kv_caches)
        self.kv_tiers = WorkerKVTiers(
            tier_caches,  # type: ignore[arg-type]
            whole,
            self.fingerprint,
            num_host_blocks=config.kv_offload_bytes // whole.bytes_per_block,
            store=kv_store,
            chunk_blocks=config.kv_chunk_tokens // bs,
            shards=self._kv_shards(),
            put_bytes=config.kv_store_put_bytes,
            mac=self._kv_mac(config) if kv_store is not None else None,
        )
        # Direct handovers (worker_svc/kv_peer.py): a prefill worker's cache as its host's peers
        # open it, and the copier that opens peers' caches and copies out of them.
        peer_kind = import_kind(self.device, self.tp.size)
        prefill = config.role == "prefill" and self.tp.size == 1
        self.kv_export = export_caches(self.kv_caches, ex.kv_segment) if prefill else None
        self.kv_peer_import = peer_kind
        self.peer_copier = PeerCopier(self.kv_caches, self.device)
        self.sampler = Sampler(mc.vocab_size, self.device, seed=config.seed)
        self.proposer = self._make_proposer(self.spec)
        # Grammar matchers of constrained sequences (the tokenizer is loaded on first use).
        self.structured = StructuredOutputManager(
            lambda: load_tokenizer(self.model_path),
            mc.vocab_size,
            mc.eos_token_ids,
            pin_memory=self.device.type == "cuda",
        )
        self._filling: LaunchedStep | None = None  # a deferred sampling whose masks are being filled
        self.seqs: dict[str, SequenceState] = {}
        # Sequences that asked for prompt logprobs: only steps that run one look for prompt rows.
        self._prompt_lp_ids: set[str] = set()
        # Pooling sequences (embeddings): their steps run eagerly and pool instead of sampling.
        self._pooling_ids: set[str] = set()
        self.pooler = Pooler(default_pooling(self.model_path, config.pooling_type))
        self.max_num_seqs = config.resolved_max_num_seqs()
        # vLLM's token budget for this device: a suggestion to schedulers that set none (WorkerInfo).
        self.suggested_batched_tokens = default_batch_limits(self.device)[1]
        self._tables = BlockTableRows(self.max_blocks_per_seq, rows=self.max_num_seqs)
        self._eos = list(mc.eos_token_ids)
        self._sleep: ExecutorSleep | None = None  # what `sleep` put away
        ex.capture_graphs()  # last, as the other ranks do: their capture's collectives match
        log.info(
            "model runner ready",
            extra={"blocks": self.num_kv_blocks, "device": str(self.device), "pooling": self.pooler.default},
        )

    @property
    def _graphs(self):  # type: ignore[no-untyped-def]
        """The decode graphs (None: eager), under the name benchmarks/ read."""
        return self.executor.graphs

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

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do at size 1)."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def release(self) -> None:
        """Stop this worker's threads and let go of every device tensor (weights, KV cache,
        graphs) for good: idempotent, the runner is unusable after. Only once no step runs
        (its step thread has ended) and after `close`."""
        if getattr(self, "executor", None) is None:
            return  # released already, or `_build` failed before the executor existed
        self.structured.close()
        self.kv_tiers.close()
        self.drop_all()
        self.peer_copier.forget()
        if self.executor.kv_segment is not None:  # its name goes; peers' mappings live on
            self.executor.kv_segment.close()
        release(self.executor)
        self.model = self.draft = self.executor = self._sleep = None  # type: ignore[assignment]
        self.sampler = None  # type: ignore[assignment]
        free_cached_memory(self.device)

    # ----- sleep (vLLM's LLM.sleep / wake_up) -----
    @property
    def is_sleeping(self) -> bool:
        return self._sleep is not None

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache and the graphs, and offload (level 1) or discard (level 2) the
        weights, until `wake_up` (worker_svc.device_memory). Forgets every sequence: the KV
        cache's contents are gone."""
        if self._sleep is not None:
            return
        self.drop_all()
        self._sleep = ExecutorSleep.start(self.executor, level)
        log.info("model runner asleep", extra={"level": level})

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore `tags` ("weights", "kv_cache"; default both); runs again once both are back."""
        if self._sleep is not None and self._sleep.wake(tags):
            self._sleep = None
            self.model = self.executor.model
            log.info("model runner awake")

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
            max_loras=self.executor.lora.max_loras if self.executor.lora is not None else 0,
            max_lora_rank=self.executor.lora.max_rank if self.executor.lora is not None else 0,
            role=self.config.role,
            kv_block_bytes=self.kv_tiers.spec.bytes_per_block,
            host_id=self.peer_copier.host,
            kv_export=self.kv_export,
            kv_peer_import=self.kv_peer_import,
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
            if new.lora_name:
                st.lora_slot = self._lora_slot(new)
            st.row = self._tables.alloc(st.block_ids)
            st.max_draft_tokens = new.max_draft_tokens
            spec = st.params.structured_outputs
            if spec is not None:  # compiles while the prompt is prefilled
                st.grammar = self.structured.start(spec, st.token_ids[st.num_prompt_tokens :])
            self.seqs[new.seq_id] = st
            if st.params.prompt_logprobs is not None:
                self._prompt_lp_ids.add(new.seq_id)
            if st.params.pooling is not None:
                self._pooling_ids.add(new.seq_id)
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
        index_of = lambda seq_id, block: self.seqs[seq_id].block_ids.index(block)  # noqa: E731
        failed = self.kv_tiers.apply(plan.kv, index_of)
        for blocks, nbytes, seconds in self.kv_tiers.take_load_reports():  # the load predictor's samples
            result.kv_load_blocks.append(blocks)
            result.kv_load_bytes.append(nbytes)
            result.kv_load_seconds.append(seconds)
        result.kv_verify_failures = self.kv_tiers.verify_failures - refused
        result.failed_load_seq_ids = list(failed)
        if plan.kv.peer_copies:  # direct handovers: blocks straight out of a prefill worker's cache
            copied = self.peer_copier.apply(plan.kv.peer_copies, index_of)
            result.peer_copy_bytes, result.peer_copy_seconds = copied.nbytes, copied.seconds
            result.failed_peer_seq_ids = list(copied.failed)
            for seq_id, first in copied.failed.items():
                failed[seq_id] = min(first, failed.get(seq_id, first))
        if not failed:
            return order
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
        self._prompt_lp_ids.discard(seq_id)
        if seq_id in self._pooling_ids:
            self._pooling_ids.discard(seq_id)
            self.pooler.forget(seq_id)
        if st is not None and st.row >= 0:
            self._tables.release(st.row)
        if st is not None and st.lora_slot >= 0 and self.executor.lora is not None:
            self.executor.lora.release(st.lora_slot)
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

    def _lora_slot(self, new: NewSequence) -> int:
        """The slot of a new sequence's adapter, loaded now if no slot holds it (ValueError if
        the worker serves no LoRA or the adapter cannot be loaded)."""
        slots = self.executor.lora
        if slots is None:
            raise ValueError(f"sequence {new.seq_id!r} names LoRA adapter {new.lora_name!r}; LoRA is off")
        try:
            return slots.acquire(new.lora_name, new.lora_path)
        except (OSError, ValueError) as e:
            raise ValueError(f"LoRA adapter {new.lora_name!r}: {e}") from None

    def drop_all(self) -> None:
        if self.executor.lora is not None:
            for st in self.seqs.values():
                self.executor.lora.release(st.lora_slot)
        self.seqs.clear()
        self._prompt_lp_ids.clear()
        self._pooling_ids.clear()
        self.pooler.forget_all()
        self._tables.clear()
        if self.proposer is not None:
            self.proposer.forget_all()

    # ----- host -> device -----
    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Tensors on the runner's device equal to `arrays` (`ModelExecutor.upload`)."""
        return self.executor.upload(arrays)

    # ----- execution -----
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan to the end (its sampled ids read back)."""
        return self.finish(self.launch(plan))

    def can_follow(self, plan: StepPlan) -> bool:
        """Whether `plan` may be launched while the step before it is still unfinished.

        The next token of a sequence in flight is known only on the device. It can be fed to
        the forward from there, but a sampler that reads the output so far (penalties, a
        seed's per-position draw, min_tokens) needs it on the host first. A grammar's next mask
        needs it too, but only for the sampling: the forward is launched ahead and the sampling
        queued once the step before is finished (`LaunchedStep.deferred`), as the GPU runs it.
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
                if uses_penalties(p) or p.seed is not None or p.min_tokens > 0:
                    return False
                if st.grammar is not None and s.num_new_tokens > 1:
                    return False  # a grammar's masks at several positions need the token on the host
        return True

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue a plan's forward and sampling; a sequence's token still in flight is read on the device.

        Apply the plan, prepare the inputs on the host (`step_inputs`), give them to the other
        ranks, run the forward (`ModelExecutor.forward`), then queue the sampling.
        """
        if self._sleep is not None:
            raise RuntimeError("the model runner is asleep: wake_up() first")
        if self._filling is not None:  # the step in flight samples before anything of this one
            self.sample_deferred(self._filling)
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
        ex = self.executor
        prompt = prompt_rows(order) if self._prompt_lp_ids else None
        # Pooling sequences (embeddings) read rows of an eager forward too, and sample nothing.
        pooling = bool(self._pooling_ids) and any(st.params.pooling is not None for st, _ in order)
        lora_slots = self._lora_slots(order)
        # Prompt logprobs read rows of an eager forward; adapter rows replay the LoRA decode graphs
        # where captured, else run eagerly (the base graphs hold no LoRA work); every other step
        # keeps its graphs.
        eager = prompt is not None or (lora_slots is not None and ex.lora_graphs is None) or pooling
        graphs = (None, None) if eager else (ex.graphs, ex.verify_graphs)
        if lora_slots is not None and not eager:
            graphs = (ex.lora_graphs, None)  # a pure decode that fits replays them, else eager
        step = prepare_step(order, self._tables.table, self.config.block_size, self.max_model_len, *graphs)
        if pooling:
            drop_pooling_samples(step, order)
        if lora_slots is not None:
            per_row = step.forward.query_lens if step.forward.mode == EAGER else 1  # graphs: decodes
            step.forward.lora_slots = np.repeat(lora_slots, per_row)
        if prompt is not None:
            self._add_prompt_rows(step.forward, prompt)
        patch = None
        if step.patch_moves is not None:
            # Tokens the step in flight samples: gathered from its sampled ids on the device.
            prev = order[step.patch_seq][0].inflight
            assert prev is not None and prev.sampled is not None
            patch = Patch(step.patch_moves, prev.sampled.sampled)
        sampling = [order[i][0] for i in step.sample_seqs]
        mask_after = self._grammars_wait_for(sampling)
        for row, st in enumerate(sampling):
            st.inflight, st.inflight_row = launched, row
        launched.sampling = sampling
        k_max = self.spec.num_speculative_tokens if self.spec else 0  # drafts to propose once sampled
        launched.propose = [min(st.max_draft_tokens, k_max) for st in sampling]
        num_verified = step.num_verified
        if num_verified:
            launched.verified = step.verified
        if self.ranks is not None:  # the other ranks run the same forward on their shards
            if step.forward.mode != EAGER:
                # A replay waits for the whole load, and so does the broadcast of the tokens in
                # flight before it: collectives on two streams must not race the load's.
                self.kv_tiers.wait_for_loads(loading)
            self.ranks.send(step.forward, patch)
        hidden, sample_index = ex.forward(step.forward, patch, loading)
        if pooling:
            launched.pooled = self.pooler.take(hidden, order)
        for st, num_new in order:
            st.num_computed_tokens += num_new
        if not sampling and prompt is None:
            return launched
        logits = ex.logits(hidden, sample_index)
        if prompt is not None:  # the prompt rows come first (`_add_prompt_rows`)
            m = len(prompt.rows)
            launched.prompt = PromptLogprobsPending(logits[:m], prompt)
            logits = logits[m:]
            if not sampling:
                return launched
        sample = self._sampler_call(
            logits, sampling, step.verified if num_verified else None, step.outputs_before
        )
        if mask_after is not None:
            # The forward is queued; the GPU runs it while the host finishes the step before
            # (next, in StepPipeline.push) and fills the masks from its tokens (`finish`).
            launched.deferred = sample
            mask_after.then_sample = launched
            return launched
        launched.sampled = sample(self.structured.bitmask([st.grammar for st in sampling]))
        return launched

    def _sampler_call(
        self,
        logits: torch.Tensor,
        sampling: list[SequenceState],
        verified: list[list[int]] | None,
        outputs_before: list[int],
    ) -> Callable[[torch.Tensor | None], SampledIds]:
        """The step's sampling, given its rows' token bitmask (host int32; None: no grammar)."""
        if verified is None:
            rows = [self._sampling_row(st) for st in sampling]
            return lambda bitmask: self.sampler.sample_async(logits, rows, bitmask)
        rows = [
            r
            for st, d, n_out in zip(sampling, verified, outputs_before, strict=True)
            for r in self._verify_rows(st, d, n_out)
        ]
        per_seq = torch.tensor([len(d) + 1 for d in verified])

        def verify(bitmask: torch.Tensor | None) -> SampledIds:
            if bitmask is not None:  # one row per position; drafting sequences are unconstrained
                bitmask = bitmask.repeat_interleave(per_seq, dim=0)
            return self.sampler.verify_async(logits, rows, verified, bitmask)

        return verify

    @staticmethod
    def _grammars_wait_for(sampling: list[SequenceState]) -> LaunchedStep | None:
        """The step in flight whose tokens these rows' grammars have yet to accept (None: none).
        At most one step is in flight when another is launched (StepPipeline)."""
        for st in sampling:
            if st.grammar is not None and st.inflight is not None:
                return st.inflight
        return None

    def _fill_masks(self, launched: LaunchedStep) -> None:
        """Start filling a deferred sampling's masks (its grammars are up to date) on the fill
        thread; `sample_deferred` queues the sampling."""
        launched.masks = self.structured.bitmask_async([st.grammar for st in launched.sampling])
        self._filling = launched

    def sample_deferred(self, launched: LaunchedStep) -> None:
        """Queue a deferred sampling (no-op if queued already), its rows masked by grammars that
        are now up to date: once its masks are filled, before anything of a later step (which
        may read its sampled ids, or overwrite the logits it samples). The step thread calls it
        after handing over the result of the step before, or when it has nothing to launch."""
        sample = launched.deferred
        if sample is None:
            return
        if self._filling is launched:  # tried once here: a failure is `finish`'s to report
            self._filling = None
        if launched.masks is None:  # the step before never finished (it failed): fill here
            mask = self.structured.bitmask([st.grammar for st in launched.sampling])
        else:
            mask = launched.masks.result()  # raises again on each call if the fill failed
        launched.sampled = sample(mask)
        launched.deferred = launched.masks = None

    def _lora_slots(self, order: list[tuple[SequenceState, int]]) -> np.ndarray | None:
        """Each sequence's adapter slot, None when none uses one (the base path: no extra work)."""
        if self.executor.lora is None:
            return None
        slots = np.fromiter((st.lora_slot for st, _ in order), dtype=np.int32, count=len(order))
        return slots if (slots >= 0).any() else None

    def finish(self, launched: LaunchedStep) -> StepResult:
        """Read a launched step's sampled ids (waiting for the device) and append them."""
        result = launched.result
        self.sample_deferred(launched)  # nothing else queued it (e.g. the step before failed)
        if launched.prompt is not None:
            result.prompt_logprobs = launched.prompt.wait()
        if launched.pooled:
            result.pooled = pooled_outputs(launched.pooled)
        if launched.sampled is None:
            return result
        token_ids, logprobs = launched.sampled.wait()
        for st, token_id in zip(launched.sampling, token_ids, strict=True):
            st.token_ids.append(token_id)
            if st.grammar is not None:
                st.grammar.accept(token_id)
            if st.inflight is launched:
                st.inflight = None
        if launched.then_sample is not None:  # its grammars have accepted these tokens
            # Filled on a thread of its own while this result is handed over; the sampling is
            # queued next (`sample_deferred`): the step thread does not wait for the GIL
            # behind the fill (issue 31).
            self._fill_masks(launched.then_sample)
            launched.then_sample = None
        if launched.verified is None:
            result.seq_ids = [st.seq_id for st in launched.sampling]
            result.token_ids, result.logprobs = token_ids, logprobs
        else:
            self._accept_drafts(launched, token_ids, logprobs)
        if any(launched.propose):
            self._propose(launched)
        return result

    @staticmethod
    def _add_prompt_rows(forward: ForwardInputs, prompt: PromptRows) -> None:
        """Take logits of the prompt rows too, ahead of the sampled ones, in the same gather
        (every tensor-parallel rank gets the same index)."""
        sampled = forward.sample_index
        if sampled is None:  # every row samples
            sampled = np.arange(len(forward.ids), dtype=np.int64)
        forward.sample_index = np.concatenate([prompt.rows, sampled.astype(np.int64)])
        forward.num_sampled += len(prompt.rows)

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
        if uses_penalties(st.params):
            prompt, out = st.token_ids[: st.num_prompt_tokens], st.token_ids[st.num_prompt_tokens :]
            outputs: list = [out + drafts[:j] for j in range(len(drafts) + 1)]
        else:  # only the count of output tokens matters (min_tokens, a seed's per-position draw)
            prompt, outputs = [], [range(num_out + j) for j in range(len(drafts) + 1)]
        return [SamplingRow(st.params, prompt, o, self._eos) for o in outputs]

    def _sampling_row(self, st: SequenceState) -> SamplingRow:
        if st.sampling_row is not None:
            return st.sampling_row
        if uses_penalties(st.params):
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
