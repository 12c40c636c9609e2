"""Model configs, safetensors loading, the Llama family and the sampler."""

from pagedkv.model.config import KVCacheLayerSpec, ModelConfig, RopeConfig
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.loader import load_model
from pagedkv.model.qwen2 import Qwen2ForCausalLM
from pagedkv.model.registry import get_model_class, supported_architectures
from pagedkv.model.sampler import (
    LogprobsTensors,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    sample,
)

__all__ = [
    "KVCacheLayerSpec",
    "LlamaForCausalLM",
    "LogprobsTensors",
    "ModelConfig",
    "Qwen2ForCausalLM",
    "RopeConfig",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_prompt_logprobs",
    "get_model_class",
    "load_model",
    "sample",
    "supported_architectures",
]
