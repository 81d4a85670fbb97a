"""The model runner: executes step plans against the model and the paged KV cache.

Stateful by design (ARCHITECTURE principle 3): it keeps every running sequence's
tokens, block table and sampling parameters, so a plan only says what changed.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from services.sampling_params import SamplingParams
from services.step import NewSequence, StepPlan, StepResult, WorkerInfo
from worker_svc.attention.base import AttentionMetadata
from worker_svc.config import WorkerConfig
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_cache, num_blocks_for_budget
from worker_svc.loader import load_model, model_fingerprint
from worker_svc.model_files import resolve_model
from worker_svc.sampler import Sampler, SamplingRow

log = logging.getLogger(__name__)


@dataclass
class SequenceState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams


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
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        self.model_path = resolve_model(config.model, config.cache_dir)
        self.backend = make_backend(config.attention_backend, self.device)
        self.model, self.model_config = load_model(
            self.model_path,
            dtype=self.dtype,
            device=self.device,
            backend=self.backend,
            load_format=config.load_format,
        )
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        spec = KVCacheSpec.of(mc, config.block_size, self.dtype)
        self.num_kv_blocks = config.num_kv_blocks or num_blocks_for_budget(spec, self._kv_budget(spec))
        if self.num_kv_blocks < 1:
            raise ValueError("the KV cache budget holds no block; raise kv_cache_memory")
        self.kv_caches = allocate_kv_cache(spec, self.num_kv_blocks, self.device)
        # Blocks are only interchangeable between workers with the same weights and cache layout.
        layout = f"{config.block_size}:{self.dtype}:{mc.num_layers}:{mc.num_kv_heads}:{mc.head_dim}"
        self.fingerprint = hashlib.sha256(model_fingerprint(self.model_path) + layout.encode()).digest()
        self.sampler = Sampler(mc.vocab_size, self.device, seed=config.seed)
        self.seqs: dict[str, SequenceState] = {}
        log.info("model runner ready", extra={"blocks": self.num_kv_blocks, "device": str(self.device)})

    def _kv_budget(self, spec: KVCacheSpec) -> int:
        if self.device.type != "cuda":
            return self.config.kv_cache_memory
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = total * (1.0 - self.config.gpu_memory_utilization)
        # Leave room for activations of the largest batch (a generous fixed margin).
        return int(max(free - reserve - (1 << 30), 0))

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
            max_num_seqs=self.config.max_num_seqs,
        )

    # ----- state -----
    def _apply(self, plan: StepPlan) -> list[tuple[str, int]]:
        for seq_id in plan.finished_ids + plan.preempted_ids:
            self.seqs.pop(seq_id, None)
        order: list[tuple[str, int]] = []
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = self._state_of(new)
            order.append((new.seq_id, new.num_new_tokens))
        for s in plan.scheduled:
            state = self.seqs.get(s.seq_id)
            if state is None:
                raise KeyError(f"plan schedules unknown sequence {s.seq_id!r}")
            state.block_ids.extend(s.new_block_ids)
            order.append((s.seq_id, s.num_new_tokens))
        return order

    @staticmethod
    def _state_of(new: NewSequence) -> SequenceState:
        return SequenceState(
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            params=new.sampling_params,
        )

    def drop_all(self) -> None:
        self.seqs.clear()

    # ----- execution -----
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        order = self._apply(plan)
        result = StepResult(step_id=plan.step_id)
        if not order:
            return result
        bs = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []  # flat index of the last token of sequences that sample
        sampling: list[str] = []
        for seq_id, num_new in order:
            st = self.seqs[seq_id]
            start, end = st.num_computed_tokens, st.num_computed_tokens + num_new
            if end > len(st.token_ids) or end > len(st.block_ids) * bs:
                raise ValueError(f"sequence {seq_id!r}: {end} tokens exceed its tokens or blocks")
            input_ids.extend(st.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(st.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            tables.append(st.block_ids)
            if end == len(st.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sampling.append(seq_id)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            self._metadata(slots, query_lens, seq_lens, tables),
        )
        for seq_id, num_new in order:
            self.seqs[seq_id].num_computed_tokens += num_new
        if not sampling:
            return result
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        rows = [self._sampling_row(self.seqs[s]) for s in sampling]
        token_ids, logprobs = self.sampler.sample(logits, rows)
        for seq_id, token_id in zip(sampling, token_ids, strict=True):
            self.seqs[seq_id].token_ids.append(token_id)
        result.seq_ids, result.token_ids, result.logprobs = sampling, token_ids, logprobs
        return result

    def _sampling_row(self, st: SequenceState) -> SamplingRow:
        return SamplingRow(
            params=st.params,
            prompt_token_ids=st.token_ids[: st.num_prompt_tokens],
            output_token_ids=st.token_ids[st.num_prompt_tokens :],
            eos_token_ids=self.model_config.eos_token_ids,
        )

    def _metadata(
        self, slots: list[int], query_lens: list[int], seq_lens: list[int], tables: list[list[int]]
    ) -> AttentionMetadata:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
