"""The model description our layers are built from, read once from a Hugging Face config."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from pagedkv.distributed.shard import kv_head_shard
from pagedkv.model.hf_config import read_hf_config

_LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_TYPES = ("default", "linear", "llama3")


class KVCacheLayerSpec(NamedTuple):
    """What the KV cache needs to know about one attention layer."""

    num_kv_heads: int
    head_size: int
    sliding_window: int | None


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str
    rope_theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> RopeConfig:
        # transformers >= 5 keeps everything in `rope_parameters`; older versions split it
        # between `rope_theta` and `rope_scaling`.
        params: dict[str, Any] = dict(
            getattr(hf_config, "rope_parameters", None)
            or getattr(hf_config, "rope_scaling", None)
            or {}
        )
        if any(key in _LAYER_TYPES for key in params):
            raise ValueError("per-layer-type rope_parameters are not supported")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {rope_type!r}; supported: {', '.join(_ROPE_TYPES)}"
            )
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        original_max = params.get("original_max_position_embeddings")
        if rope_type == "llama3" and original_max is None:
            original_max = hf_config.max_position_embeddings
        return cls(
            rope_type=rope_type,
            rope_theta=float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original_max,
        )


def _torch_dtype(hf_config: Any) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if dtype is None:
        return torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Per-layer window: ``layer_types`` when the config has them, else every layer (Mistral)."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return (window,) * num_layers
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}; supported: {', '.join(_LAYER_TYPES)}")
    if len(layer_types) != num_layers:
        raise ValueError(f"{len(layer_types)} layer_types for {num_layers} layers")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    sliding_windows: tuple[int | None, ...]  # one per layer; None = full attention
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    dtype: torch.dtype

    @classmethod
    def from_hf_config(cls, hf_config: Any, dtype: torch.dtype | None = None) -> ModelConfig:
        """Read a Llama-family config; ``dtype`` overrides the checkpoint's own."""
        hidden_act = getattr(hf_config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: silu")
        num_heads = hf_config.num_attention_heads
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            rope=RopeConfig.from_hf_config(hf_config),
            sliding_windows=_sliding_windows(hf_config),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            dtype=dtype or _torch_dtype(hf_config),
        )

    @classmethod
    def from_pretrained(
        cls, model_path: str | os.PathLike[str], dtype: torch.dtype | None = None
    ) -> ModelConfig:
        return cls.from_hf_config(read_hf_config(model_path), dtype)

    def kv_cache_layer_specs(self, tp_size: int = 1) -> list[KVCacheLayerSpec]:
        """Each layer's cache on one of ``tp_size`` ranks: its KV heads (``kv_head_shard``; as
        many on every rank)."""
        num_kv_heads = kv_head_shard(self.num_key_value_heads, 0, tp_size).size
        return [
            KVCacheLayerSpec(num_kv_heads, self.head_dim, window) for window in self.sliding_windows
        ]
