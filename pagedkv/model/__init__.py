"""Model configs, safetensors loading, the Llama family and the sampler."""

from pagedkv.model.config import KVCacheLayerSpec, ModelConfig, RopeConfig
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.loader import load_model
from pagedkv.model.qwen2 import Qwen2ForCausalLM
from pagedkv.model.registry import get_model_class, supported_architectures

__all__ = [
    "KVCacheLayerSpec",
    "LlamaForCausalLM",
    "ModelConfig",
    "Qwen2ForCausalLM",
    "RopeConfig",
    "get_model_class",
    "load_model",
    "supported_architectures",
]
