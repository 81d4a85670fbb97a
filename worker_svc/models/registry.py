"""Maps a config.json `architectures[0]` to the class that implements it."""

from __future__ import annotations

from torch import nn

from worker_svc.models.llama import LlamaForCausalLM

# Every entry takes (ModelConfig, AttentionBackend) and has forward/compute_logits/load_weights.
_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(arch: str) -> type[nn.Module]:
    try:
        return _MODELS[arch]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(supported_architectures())}"
        ) from None
