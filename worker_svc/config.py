"""Worker configuration: one dataclass, built from CLI flags/env by the service, passed down.

torch is imported where a method needs it, not by this module: `llmesh up` builds its
`--worker.*` flags from `WorkerConfig` without loading torch into the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from services.config import ByteSize, option

if TYPE_CHECKING:
    import torch


@dataclass
class WorkerConfig:
    model: str | None = None  # HF folder or .gguf path; None = the embedded SmolLM2-135M-Instruct
    cache_dir: str | None = None  # converted-model cache (default $LLMESH_CACHE or ~/.cache/llmesh)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    attention_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | triton
    load_format: str = "auto"  # auto | dummy (random weights made on the device)
    block_size: int = 16
    num_kv_blocks: int = 0  # 0 = from the memory budget below
    kv_cache_memory: ByteSize = ByteSize(1 << 30)  # bytes of KV cache on CPU (a unit may be given: 64MiB)
    gpu_memory_utilization: float = 0.9  # fraction of device memory for weights + KV on CUDA
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    max_num_seqs: int = option(
        0,
        help="largest decode batch, CUDA graphs are captured up to it (0: by device, as vLLM: 1024 on "
        "GPUs of 70 GiB or more, 256 on smaller ones, 64 on the CPU)",
    )
    enforce_eager: bool = False  # no CUDA graphs
    # The worker's host (CPU) KV tier: bytes of blocks kept after they leave the GPU cache (0 = off).
    kv_offload_bytes: ByteSize = ByteSize(0)
    # The shared KV store (host:port; None = none) and its unit: tokens per chunk, a whole
    # number of blocks (LMCache's 256: few entries and round trips per prompt).
    kvstore_address: str | None = None
    kv_chunk_tokens: int = 256
    kv_store_shared_memory: Literal["auto", "on", "off"] = option(
        "auto",
        help="move KV payloads to and from the store through shared memory segments (/dev/shm) instead "
        "of gRPC: auto = when --kvstore-address is this host's (loopback); the worker streams if the "
        "store cannot open them",
    )
    kv_store_segment_bytes: ByteSize = option(
        ByteSize("128MiB"),
        help="size of each of the worker's two shared memory segments (made when first used); a load "
        "or put of more goes in rounds",
    )
    kv_store_put_bytes: ByteSize = option(
        ByteSize("2GiB"),
        help="host memory for chunks on their way to the KV store (on CUDA pinned, allocated once at "
        "start: a put is one DMA into it, never an allocation on the step); a put that finds it full is "
        "dropped, which costs a later hit and nothing else",
    )
    kv_store_transfer: Literal["auto", "bulk", "grpc", "shm"] = option(
        "auto",
        help="how KV payloads come from the store: auto = its bulk TCP path when the store is on "
        "another host, shared memory when on this one; bulk = the bulk path even on loopback (no "
        "shared memory: a store on this host measured as if on another); grpc = the Get stream "
        "only; shm = shared memory (the store's arena in place, or segments). A path that fails "
        "falls back to the Get stream",
    )
    speculative_config: str | None = option(
        None,
        help='speculative decoding, as vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or \'{"method": "draft_model", '
        '"num_speculative_tokens": 3, "num_layers": 8}\' (none = off)',
    )
    seed: int = 0
    # Disaggregated prefill/decode (scheduler_svc/disaggregation.py): the scheduler sends long
    # prompts to prefill workers and their decode, after the KV handover, to decode workers.
    role: Literal["both", "prefill", "decode"] = option(
        "both",
        help="this worker's part in disaggregated serving: both = whole requests; prefill = prompts "
        "and their first token (the KV goes to a decode worker through the KV store); decode = the "
        "decode of handed-over requests and whole short ones",
    )
    # Multi-LoRA (worker_svc/lora): PEFT adapters in `max_loras` device slots, loaded when a
    # sequence names one (least recently used out); --lora-modules are loaded at start.
    enable_lora: bool = option(False, help="serve LoRA adapters (on when --lora-modules is given)")
    max_loras: int = option(4, ge=1, help="LoRA adapters on the device at once (one batch mixes this many)")
    max_lora_rank: int = option(16, ge=1, help="largest LoRA rank served (the slots' rank)")
    lora_modules: list[str] = option(
        default_factory=list, help="LoRA adapters to load at start, name=path (comma-separated)"
    )
    # Tensor parallelism: processes cuda:i, cuda:i+1, ... (gloo processes on CPU) that split the
    # model's heads, MLP and vocabulary.
    tensor_parallel_size: int = option(
        1, ge=1, help="ranks splitting the model; must divide its query and KV heads"
    )
    tp_timeout_s: float = 600.0  # longest wait on a tensor-parallel collective before a step fails
    tp_all_reduce: Literal["auto", "nccl"] = option(
        "auto",
        help="tensor-parallel all-reduce on CUDA: auto = a one-shot peer-to-peer all-reduce over "
        "PyTorch symmetric memory for messages up to 8 MiB (decode steps; no NVLink multicast), "
        "NCCL above and wherever it cannot start; nccl = NCCL for every message",
    )

    quantization: Literal["fp8"] | None = option(
        None,
        help="fp8: W8A8 e4m3, the linear layers' weights quantized on load with one scale per output "
        "channel, activations per token at each GEMM (vLLM's dynamic FP8); none: the model's dtype",
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = option(
        "auto",
        help="the paged KV cache's dtype (vLLM's names): auto = the model's; fp8 (= fp8_e4m3) = "
        "float8 e4m3 with one scale per layer for K and one for V, measured on a calibration "
        "prompt at start (worker_svc/kv_scales.py): half the bytes a block, twice the blocks",
    )
    pooling_type: Literal["last", "mean", "cls"] | None = option(
        None,
        help="how pooling requests (embeddings) pool the prompt's final hidden states when they ask for "
        "the model's default: last token, mean or first (CLS); none = the model folder's "
        "sentence-transformers pooling config, else last",
    )
    decode_gemm: Literal["auto", "cublas"] = option(
        "auto",
        help="the decode graphs' GEMMs on CUDA: auto = each weight shape timed at start, cuBLAS "
        "against a Triton skinny GEMM (used for batches of up to 16), the faster kept; "
        "cublas = cuBLAS for every GEMM",
    )

    def resolved_max_num_seqs(self) -> int:
        return self.max_num_seqs or default_batch_limits(self.torch_device())[0]

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype not in names:
            raise ValueError(f"dtype must be one of auto, {', '.join(names)}; got {self.dtype!r}")
        return names[self.dtype]

    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model's dtype, or float8_e4m3fn for fp8."""
        import torch

        if self.kv_cache_dtype == "auto":
            return self.torch_dtype()
        if self.kv_cache_dtype in ("fp8", "fp8_e4m3"):
            return torch.float8_e4m3fn
        raise ValueError(f"kv_cache_dtype must be auto, fp8 or fp8_e4m3; got {self.kv_cache_dtype!r}")


def default_batch_limits(device: torch.device, offline: bool = False) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) where none is given: vLLM's defaults by device.

    A GPU of 70 GiB or more (H100, H200, MI300; not an A100, where vLLM measured big budgets
    lose) takes 1,024 sequences and 16,384 tokens a step offline (8,192 served); a smaller GPU
    256 and 8,192 (2,048); the CPU 64 and 2,048, sized for its slow steps.
    """
    if device.type != "cuda":
        return 64, 2048
    import torch

    props = torch.cuda.get_device_properties(device)
    if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower():
        return 1024, 16384 if offline else 8192
    return 256, 8192 if offline else 2048
