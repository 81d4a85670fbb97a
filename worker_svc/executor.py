"""The model side of a worker, the same on every tensor-parallel rank.

A `ModelExecutor` loads its rank's shard of the model, sizes and allocates its share of the
paged KV cache, captures the CUDA graphs, and runs a step's forward from host inputs
(`rank_channel.ForwardInputs`). Rank 0's `ModelRunner` owns one beside the sequences' state
and the sampler; every other rank (`rank_worker`) owns one and nothing else. Rank N is rank 0
without sequences: one code path builds both, so their collectives (the KV block count's
minimum, the forward's all-reduces, the capture's) come in the same order on every rank.

A draft model (speculative decoding) lives whole on rank 0, which alone proposes: its KV
cache has a slot per target block, so on rank 0 it shares the block budget, and the block
count every rank uses is the least any rank holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention_metadata import AttentionMetadata
from services.model_files import default_cache_dir
from worker_svc.config import WorkerConfig
from worker_svc.decode_gemms import choose_decode_gemms
from worker_svc.kv_cache import (
    KVCacheSpec,
    allocate_kv_cache,
    kv_budget_bytes,
    num_blocks_for_budget,
    shared_kv_segment,
)
from worker_svc.kv_tiers import wait_for_loads
from worker_svc.loader import load_model
from worker_svc.lora.layer import LoRABatch
from worker_svc.lora.slots import make_lora_slots
from worker_svc.parallel import TensorParallel
from worker_svc.rank_channel import DECODE_GRAPH, EAGER, ForwardInputs
from worker_svc.spec_decode.config import SpeculativeConfig
from worker_svc.spec_decode.draft_model import DraftModel
from worker_svc.step_inputs import round16

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Patch:
    """Input ids that a step still on the device samples: ids[moves[0, j]] = sampled[moves[1, j]].

    moves: int64 [2, n] on the host (input positions, rows of `sampled`); sampled: that step's
    ids on the device. A decode graph's inputs take it in the kernel that places them
    (`kernels.triton.pinned_io`); an eager forward uploads `moves` with its other inputs.
    """

    moves: np.ndarray
    sampled: torch.Tensor

    def gathered(self) -> torch.Tensor:
        """int64 [n]: the ids the patch writes, on the device (for the other tensor-parallel ranks)."""
        rows = torch.from_numpy(np.ascontiguousarray(self.moves[1])).to(
            self.sampled.device, non_blocking=True
        )
        return self.sampled.index_select(0, rows).to(torch.int64)


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


class ModelExecutor:
    def __init__(self, config: WorkerConfig, tp: TensorParallel, model_path: str) -> None:
        """Load the model (and, on rank 0, a draft model) and allocate the KV cache.

        `tp.min_int` is a collective: every rank builds its executor at the same point.
        Graphs are captured later (`capture_graphs`), once the caller has built the rest.
        """
        if config.decode_gemm not in ("auto", "cublas"):
            raise ValueError(f"decode_gemm must be auto or cublas, got {config.decode_gemm!r}")
        self.config = config
        self.tp = tp
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        self.model_path = model_path
        self.backend = make_backend(config.attention_backend, self.device)
        self.model, self.model_config = load_model(
            model_path,
            dtype=self.dtype,
            device=self.device,
            backend=self.backend,
            load_format=config.load_format,
            tp=tp,
            quantization=config.quantization,
        )
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        bs = config.block_size
        # Block-table widths are kept multiples of 16 (`round16`).
        self.max_blocks_per_seq = round16((self.max_model_len + bs - 1) // bs)
        self.spec = spec = SpeculativeConfig.parse(config.speculative_config)
        with_draft = spec is not None and spec.method == "draft_model" and tp.is_first
        self.draft = DraftModel(spec, self) if spec is not None and with_draft else None
        # LoRA adapters' slots (None: none served), before the KV cache takes what memory is left.
        # Decodes with adapter rows replay lora_graphs.
        self.lora = make_lora_slots(config, self.model, self.dtype)
        self.kv_cache_dtype = config.kv_cache_torch_dtype()
        kv_spec = KVCacheSpec.of(mc, bs, self.kv_cache_dtype, tp.size)
        self.num_kv_blocks = self._count_blocks(kv_spec)
        # A CPU prefill worker's cache lives in shared memory, so decode workers of its host copy
        # handed-over blocks straight out of it (worker_svc/kv_peer.py); a CUDA one exports as is.
        exportable = self.device.type == "cpu" and config.role == "prefill" and tp.size == 1
        self.kv_segment = shared_kv_segment(kv_spec, self.num_kv_blocks) if exportable else None
        if self.kv_segment is not None:
            self.kv_caches = list(self.kv_segment.tensors)
        else:
            self.kv_caches = allocate_kv_cache(kv_spec, self.num_kv_blocks, self.device)
        # An fp8 cache's scales, measured once the cache is allocated: the calibration prefill's
        # kernels and workspaces then come out of the activation margin, as the first step's
        # do, not out of the KV budget (measured before: 1.94x a bf16 cache's blocks, not 2x).
        self.kv_scale_exponents = self._calibrate_kv_scales(KVCacheSpec.of(mc, bs, self.dtype, tp.size))
        if self.draft is not None:
            self.draft.allocate(self.num_kv_blocks, self.device)
        self.graphs = None  # DecodeGraphs once captured
        self.verify_graphs = None  # DecodeGraphs of 1 + num_speculative_tokens rows per sequence
        self.lora_graphs = None  # LoRADecodeGraphs once captured

    def _calibrate_kv_scales(self, scratch: KVCacheSpec) -> list[tuple[int, int]] | None:
        """An fp8 cache's (K, V) scale exponents per layer, given to the model's attention
        layers (worker_svc/kv_scales.py); None for a cache in the model's dtype. `scratch`: this
        rank's cache layout in the model's dtype, for the calibration prefill."""
        if self.kv_cache_dtype != torch.float8_e4m3fn:
            return None
        from worker_svc import kv_scales

        mc = self.model_config
        exps = kv_scales.measure_kv_exponents(
            self.model, scratch, mc.vocab_size, self.max_model_len, self.device, self.tp
        )
        kv_scales.attach_kv_scales(self.model, exps, self.device)
        if self.device.type == "cuda":  # the scratch cache and its activations
            torch.cuda.empty_cache()
        log.info("fp8 KV cache scales", extra={"exponents": kv_scales.describe(exps)})
        return exps

    def _count_blocks(self, kv_spec: KVCacheSpec) -> int:
        """The KV blocks every rank holds: each its heads' share of every block, so the least
        any rank's memory holds (a collective). A draft model's cache has a block for each of
        the target's: where it lives, the two share the budget."""
        c = self.config
        per_block = kv_spec.bytes_per_block + (self.draft.kv_spec.bytes_per_block if self.draft else 0)
        budget = kv_budget_bytes(self.device, c.kv_cache_memory, c.gpu_memory_utilization)
        num_blocks = self.tp.min_int(c.num_kv_blocks or num_blocks_for_budget(budget, per_block), self.device)
        if num_blocks < 1:
            raise ValueError("the KV cache budget holds no block; raise kv_cache_memory")
        return num_blocks

    def capture_graphs(self) -> None:
        """Capture the decode graphs, on CUDA with the Triton backend unless `enforce_eager`.

        Verification steps (speculative decoding) replay graphs of 1 + num_speculative_tokens
        query rows per sequence: eager, a small model's verification costs several decode steps.
        Only at size 1: the other ranks would need them too.
        """
        c = self.config
        if self.device.type != "cuda" or self.backend.name != "triton" or c.enforce_eager:
            return
        from worker_svc.cuda_graphs import DecodeGraphs, capture_sizes

        if c.decode_gemm == "auto":
            models = [self.model] + ([self.draft.model] if self.draft else [])
            choose_decode_gemms(models, self.device, c.cache_dir or default_cache_dir())
        sizes = capture_sizes(c.resolved_max_num_seqs())
        self.graphs = DecodeGraphs(self, sizes)
        self.graphs.capture()
        if self.spec is not None and self.tp.size == 1:
            self.verify_graphs = DecodeGraphs(self, sizes, query_len=1 + self.spec.num_speculative_tokens)
            self.verify_graphs.capture()
        if self.lora is not None:  # decodes with adapter rows replay these (the base ones hold no LoRA)
            from worker_svc.lora.graphs import LoRADecodeGraphs

            self.lora_graphs = LoRADecodeGraphs(self, sizes, self.lora)
            self.lora_graphs.capture()

    # ----- host -> device -----
    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Tensors on this rank's device equal to `arrays` (int32/int64 numpy).

        On CPU they share the arrays' memory; on CUDA they arrive in one non-blocking copy.
        """
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        return pack_to_device(arrays, self.device)

    # ----- forward -----
    def forward(
        self, inp: ForwardInputs, patch: Patch | None = None, layer_ready: list | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Queue one step's forward: its hidden states and the rows to take logits of (None: all).

        `patch` overwrites input ids with tokens still on the device. `layer_ready`: a host
        load's per-layer events (`WorkerKVTiers.take_layer_events`); an eager forward waits on
        each before its layer, a graph replay on the whole load first. Call under
        `torch.inference_mode()`.
        """
        if inp.mode != EAGER:
            graphs = self.graphs if inp.mode == DECODE_GRAPH else self.verify_graphs
            if inp.lora_slots is not None:  # the runner picks DECODE_GRAPH for these only if captured
                assert self.lora_graphs is not None and inp.mode == DECODE_GRAPH
                graphs = self.lora_graphs.with_rows(inp.lora_slots)
            assert graphs is not None, f"forward mode {inp.mode} replays graphs this rank did not capture"
            wait_for_loads(layer_ready, self.device)
            hidden = graphs.run(inp.ids, inp.positions, inp.slots, inp.seq_lens, inp.tables, patch)
            index = None if inp.sample_index is None else self.upload([inp.sample_index])[0]
            return hidden, index
        arrays = [inp.ids, inp.positions, inp.slots, inp.query_start_loc, inp.seq_lens, inp.tables]
        if inp.sample_index is not None:
            arrays.append(inp.sample_index)
        lora = self.lora.batch_arrays(inp.lora_slots) if self.lora and inp.lora_slots is not None else None
        if lora is not None:
            arrays += lora[:2]
        if patch is not None:
            arrays.append(patch.moves)
        d = self.upload(arrays)  # one copy
        if patch is not None:
            moves = d.pop()
            d[0].index_copy_(0, moves[0], patch.sampled.index_select(0, moves[1]).to(torch.int64))
        if lora is not None:
            assert self.lora is not None
            self.lora.set_batch(LoRABatch(d[-2], d[-1], lora[2]))
        meta = AttentionMetadata(
            slot_mapping=d[2],
            query_start_loc=d[3],
            seq_lens=d[4],
            block_tables=d[5],
            max_query_len=inp.max_query_len,
            max_seq_len=inp.max_seq_len,
            query_lens_cpu=inp.query_lens.tolist(),
            seq_lens_cpu=inp.seq_lens.tolist(),
            layer_ready=layer_ready,
        )
        try:
            hidden = self.model(d[0], d[1], self.kv_caches, meta)
        finally:
            if lora is not None:
                self.lora.set_batch(None)  # type: ignore[union-attr]
        wait_for_loads(layer_ready, self.device)
        if self.draft is not None:  # a draft model's KV follows the target's
            self.draft.forward_alongside(d[0], d[1], meta)
        return hidden, (d[6] if inp.sample_index is not None else None)

    def logits(self, hidden: torch.Tensor, sample_index: torch.Tensor | None) -> torch.Tensor | None:
        """Logits of the sampled rows: whole on rank 0, None on the others (they join the gather)."""
        return self.model.compute_logits(hidden if sample_index is None else hidden[sample_index])
