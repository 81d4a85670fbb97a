from worker_svc.models.config import ModelConfig
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.models.registry import get_model_class, supported_architectures

__all__ = ["LlamaForCausalLM", "ModelConfig", "get_model_class", "supported_architectures"]
