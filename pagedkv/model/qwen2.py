"""Qwen2: Llama with a bias on the q/k/v projections (none on o_proj), hard-coded by the
architecture rather than read from the config. Hybrid sliding/full layers come from
``config.layer_types`` (``use_sliding_window`` + ``max_window_layers``)."""

from __future__ import annotations

from pagedkv.model.config import ModelConfig
from pagedkv.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        return True, False
