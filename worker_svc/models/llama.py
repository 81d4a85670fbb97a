"""The Llama-family decoder in plain PyTorch, over a paged KV cache.

One class serves Llama 2/3 (and SmolLM2), Mistral, Qwen2/2.5 and Qwen3; the config's
flags (qkv bias, q/k norm, tied embeddings, rope scaling) select the differences.

The batch is flat (varlen): `input_ids`/`positions` are [T] over all sequences of
the step, and the attention backend uses `AttentionMetadata` to find each token's
sequence in the paged cache. So the model has no batch dimension and no padding.

Mistral's sliding window is NOT applied: every layer attends to the full context.
Results equal Hugging Face's only while a sequence is no longer than the window
(4096 for Mistral 7B); `ModelConfig.sliding_window` records it so callers can cap
the context length.

Projections are merged as in vLLM: q/k/v into one `qkv_proj` and gate/up into one
`gate_up_proj`, fewer and larger matmuls. `load_weights` takes Hugging Face's
unmerged names and copies each into its slice.

The norms and the MLP's SiLU-and-multiply follow the attention backend: with the Triton
backend they run the Triton kernels (fused residual-add + RMSNorm, one pass of SiLU(gate) * up;
on CPU tensors under Triton's interpreter), otherwise their plain-PyTorch twins from
`kernels.reference`. The rotary is the backend's own: the Triton one rotates q and k in the
kernel that writes the KV cache.

Tensor parallelism (`tp`, `worker_svc.parallel`): each rank builds the layers of
`worker_svc.models.parallel_layers`, holding 1/N of the query and KV heads, of the MLP and of
the vocabulary; o_proj, down_proj and the embedding end in an all-reduce, the logits are
gathered to rank 0. At size 1 (the default) they are plain layers and no collective runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from kernels import reference
from kernels.attention_metadata import AttentionMetadata
from worker_svc.attention.base import AttentionBackend
from worker_svc.models.config import ModelConfig
from worker_svc.models.fp8 import Fp8Rows
from worker_svc.models.parallel_layers import (
    GATED_GEMM,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from worker_svc.parallel import TensorParallel


def compute_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim/2] in fp32, exactly as transformers computes them.

    services/model_files.py's `rope_inv_freq` is its numpy twin (the GGUF converter checks
    llama.cpp's rope_freqs without torch); change both together."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise NotImplementedError(f"rope type {rope_type!r}")


class RotaryEmbedding(nn.Module):
    """Holds the [max_pos, head_dim] cos|sin cache that the attention backend's rotary indexes
    by position.

    The cache is derived data: it is always fp32 and is recomputed (not converted)
    whenever the module moves, so `model.to(torch.bfloat16)` or `to_empty()` from the
    meta device never degrade or garble it.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Built on the default device, so constructing under `torch.device("meta")` costs nothing.
        self.register_buffer("cos_sin_cache", self._build(torch.get_default_device()), persistent=False)

    def _build(self, device: torch.device) -> torch.Tensor:
        if device.type == "meta":
            return torch.empty(self.config.max_position_embeddings, self.config.head_dim, device=device)
        inv_freq = compute_inv_freq(self.config).to(device)
        t = torch.arange(self.config.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self.cos_sin_cache = self._build(self.cos_sin_cache.device)
        return self


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernel = reference.rms_norm
        self.fp8_kernel = reference.rms_norm_fp8  # the same pass ending in FP8 rows

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8: bool = False
    ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """(normed, new residual); with `fp8` normed comes quantized per token for the FP8
        GEMM that follows (worker_svc/models/fp8.py): no quantization kernel of its own."""
        if fp8:
            q, scale, residual = self.fp8_kernel(x, self.weight, self.eps, residual)
            return Fp8Rows(q, scale, torch.promote_types(self.weight.dtype, residual.dtype)), residual
        return self.kernel(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # This rank's heads (all of them at size 1).
        self.num_heads = tp.shard(config.num_heads, "query heads")
        self.num_kv_heads = tp.shard(config.num_kv_heads, "KV heads")
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.backend = backend
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.q_size, config.kv_size, config.attention_bias, tp
        )
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, config.o_proj_bias, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # An fp8 KV cache's scales (worker_svc/kv_scales.py), fp32 [4] on the device; None: the
        # cache is in the model's dtype. Not a buffer: no checkpoint holds it.
        self.kv_scale: torch.Tensor | None = None

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor | Fp8Rows,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x), rotary, kv_cache, meta))

    def attend(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The attention over q|k|v rows [T, q + 2 kv]: [T, q_size], for o_proj."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)[0]
            k = self.k_norm(k)[0]
        if meta.layer_ready is not None:  # this layer's loaded blocks may still be on their way
            torch.cuda.current_stream(q.device).wait_event(meta.layer_ready[self.layer_idx])
        # The backend rotates q and k as it writes the cache (one kernel on the Triton path).
        o = self.backend.forward(
            q, k, v, kv_cache, meta, self.scale,
            rotary=(positions, rotary.cos_sin_cache), kv_scale=self.kv_scale,
        )  # fmt: skip
        return o.reshape(t, self.q_size)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.intermediate_size = tp.shard(config.intermediate_size, "intermediate size")  # this rank's
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, config.intermediate_size, config.mlp_bias, tp
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, config.mlp_bias, tp)
        self.act = reference.silu_and_mul  # the Triton kernel with the Triton backend
        self.act_fp8 = reference.silu_and_mul_fp8  # the same ending in FP8 rows

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        # A decode graph's: SiLU·mul (and an FP8 down projection's quantization) in the GEMM.
        y = self.gate_up_proj.decode_silu_and_mul(x, quantize=self.down_proj.takes_fp8_rows())
        if y is not None:
            return self.down_proj(y)
        h = self.gate_up_proj(x)
        if self.down_proj.takes_fp8_rows():  # quantized in SiLU·mul's pass, for the FP8 GEMM
            q, scale = self.act_fp8(h)
            return self.down_proj(Fp8Rows(q, scale, h.dtype))
        return self.down_proj(self.act(h))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream travels beside `hidden` so each norm fuses the add (and, before
        # FP8 layers, the quantization of its output).
        fp8 = self.self_attn.qkv_proj.takes_fp8_rows()
        x, residual = self.input_layernorm(hidden, residual, fp8=fp8)
        h = self.self_attn(positions, x, rotary, kv_cache, meta)
        fp8 = self.mlp.gate_up_proj.takes_fp8_rows()
        x, residual = self.post_attention_layernorm(h, residual, fp8=fp8)
        return self.mlp(x), residual

    def folds_norms(self, stream: torch.Tensor) -> bool:
        """Whether both residual norms fold into this layer's GEMMs (a decode graph's bf16
        skinny GEMMs: `ShardedLinear.folds_norms`)."""
        attn, mlp = self.self_attn, self.mlp
        layers = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return all(layer.folds_norms(stream) for layer in layers)

    def forward_norms_in_gemms(
        self,
        positions: torch.Tensor,
        stream: torch.Tensor,
        scaled: torch.Tensor | None,
        squares: torch.Tensor | None,
        next_norm: RMSNorm | None,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The layer with its norms in its GEMMs (kernels.triton.skinny_gemm's module doc): takes
        the residual stream whole and, from the GEMM before, its h * g and squares for this
        layer's input norm (None: the first layer, whose norm is its kernel); returns the stream
        and the same for `next_norm` (None after the last layer: the model's final norm is its
        kernel)."""
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if scaled is None or squares is None:
            qkv = attn.qkv_proj(norm1(stream)[0])
        else:
            qkv = attn.qkv_proj.decode_normed(scaled, squares, norm1.eps)
        o = attn.attend(positions, qkv, rotary, kv_cache, meta)
        stream, scaled, squares = attn.o_proj.decode_add_to(o, stream, norm2.weight)
        assert scaled is not None and squares is not None
        if GATED_GEMM and stream.dtype in (torch.bfloat16, torch.float16):  # SiLU·mul rounds to it
            y = mlp.gate_up_proj.decode_normed(scaled, squares, norm2.eps, gated=True)
        else:
            y = mlp.act(mlp.gate_up_proj.decode_normed(scaled, squares, norm2.eps))
        return mlp.down_proj.decode_add_to(y, stream, None if next_norm is None else next_norm.weight)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over a paged KV cache."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.config = config
        self.backend = backend
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        # Tied models reuse the embedding matrix; no separate parameter exists.
        self.lm_head = (
            None if config.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        )
        self._select_kernels(backend)

    def set_backend(self, backend: AttentionBackend) -> None:
        """Swap the attention implementation (e.g. torch reference ↔ Triton) in every layer."""
        self.backend = backend
        for layer in self.layers:
            layer.self_attn.backend = backend
        self._select_kernels(backend)

    def _select_kernels(self, backend: AttentionBackend) -> None:
        """Norm and SiLU-and-mul kernels to match the attention backend (see the module doc)."""
        if getattr(backend, "name", None) == "triton":
            import kernels.triton as kt

            norm, act = kt.rms_norm, kt.silu_and_mul
            norm_fp8, act_fp8 = kt.rms_norm_fp8, kt.silu_and_mul_fp8
        else:
            norm, act = reference.rms_norm, reference.silu_and_mul
            norm_fp8, act_fp8 = reference.rms_norm_fp8, reference.silu_and_mul_fp8
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel, module.fp8_kernel = norm, norm_fp8
            elif isinstance(module, MLP):
                module.act, module.act_fp8 = act, act_fp8

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of a flat batch; writes the new K/V into `kv_caches`."""
        hidden = self.embed_tokens(input_ids)
        if self._folds_norms(hidden):
            return self._forward_norms_in_gemms(positions, hidden, kv_caches, meta)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, self.rotary, kv_caches[i], meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _folds_norms(self, hidden: torch.Tensor) -> bool:
        """Whether every layer folds its norms (outside a decode graph the first says no)."""
        return len(self.layers) > 0 and all(layer.folds_norms(hidden) for layer in self.layers)

    def _forward_norms_in_gemms(
        self,
        positions: torch.Tensor,
        stream: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """A decode graph's forward with the residual norms in the skinny GEMMs: 2 norm kernels a
        step (the first layer's input, the final norm) instead of 2 a layer; in a bf16 batch-1
        step each cost ~2.7 us."""
        scaled = squares = None
        layers = self.layers
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            stream, scaled, squares = layer.forward_norms_in_gemms(
                positions, stream, scaled, squares, next_norm, self.rotary, kv_caches[i], meta
            )
        return self.norm(stream)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, vocab] (the model's dtype) for the rows of `hidden` the caller wants to sample
        (on tensor-parallel rank 0; the other ranks send their vocabulary's share and get None)."""
        return vocab_parallel_logits(hidden, self.embed_tokens if self.lm_head is None else self.lm_head)

    # ---- weights -------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our (partly merged) parameters.

        Every parameter must be written exactly once; a missing or unknown name is an error,
        because a silently random weight produces plausible-looking garbage.
        A tensor may be a lazy safetensors slice: a split layer then reads only its rank's rows.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        cfg = self.config
        # HF name suffix -> (our suffix, segment) inside a merged parameter.
        merged = {
            "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
            "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
            "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
            "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
            "mlp.up_proj": ("mlp.gate_up_proj", "up"),
        }
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # old checkpoints saved the derived buffer; we compute our own
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still store the duplicate
            key = name.removeprefix("model.")
            target, segment = key, None
            for hf, (ours, seg) in merged.items():
                if f".{hf}." in key:
                    target, segment = key.replace(hf, ours), seg
                    break
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
            owner, _, param_name = target.rpartition(".")
            module = modules[owner]
            try:
                if hasattr(module, "load_segment"):  # a split (or merged) layer takes its own slice
                    module.load_segment(param_name, segment, tensor)
                else:
                    src = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
                    dest = params[target].data
                    if dest.shape != src.shape:
                        raise ValueError(f"checkpoint shape {tuple(src.shape)} != {tuple(dest.shape)}")
                    dest.copy_(src)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            loaded.add(key)
        expected = {n.removeprefix("model.") for n in self.expected_weight_names()}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")

    def expected_weight_names(self) -> list[str]:
        """The Hugging Face tensor names this model needs (what `load_weights` checks for)."""
        names: list[str] = []
        for name, _ in self.named_parameters():
            if name.startswith("lm_head."):
                names.append(name)
                continue
            if ".qkv_proj." in name:
                names += [name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
            elif ".gate_up_proj." in name:
                names += [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
            else:
                names.append(name)
        return [n if n.startswith("lm_head.") else "model." + n for n in names]
