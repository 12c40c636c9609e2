"""The Llama family (Llama, Mistral, Qwen2): our layers over the paged KV cache.

q/k/v and gate/up projections are fused into one Linear each at load time; the checkpoint's
separate tensors are copied into row ranges of the fused weight (``load_weights``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention import ForwardContext
from pagedkv.model.config import ModelConfig
from pagedkv.model.rms_norm import RMSNorm
from pagedkv.model.rotary_embedding import RotaryEmbedding, apply_rotary_emb


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, qkv_bias: bool, o_proj_bias: bool
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_proj_bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        qk_size = self.q_size + self.kv_size
        # q and k are adjacent in the fused output: one rotary call covers both.
        qk = apply_rotary_emb(qkv[:, :qk_size].view(num_tokens, -1, self.head_dim), cos, signed_sin)
        query, key = qk[:, : self.num_heads], qk[:, self.num_heads :]
        value = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)

        kv_cache = ctx.kv_caches[self.layer_idx]
        metadata = ctx.attn_metadata[self.layer_idx]
        connector = ctx.kv_connector
        if connector is not None:
            connector.wait_for_layer_load(self.layer_idx)
        ctx.backend.reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        if connector is not None:
            connector.save_kv_layer(self.layer_idx, kv_cache, metadata)
        out = ctx.backend.forward(query, kv_cache, metadata, self.scaling)
        return self.o_proj(out.view(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, qkv_bias: bool, o_proj_bias: bool
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, qkv_bias, o_proj_bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), cos, signed_sin, ctx
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, o_proj_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias, o_proj_bias)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        cos, signed_sin = self.rotary_emb(positions, hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, signed_sin, ctx)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    """Also serves ``MistralForCausalLM``: same weights, and the per-layer sliding windows come
    from the config (``ModelConfig.sliding_windows``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        qkv_bias, o_proj_bias = self.attention_biases(config)
        self.model = LlamaModel(config, qkv_bias, o_proj_bias)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """Whether the q/k/v projections and o_proj carry a bias."""
        return config.attention_bias, config.attention_bias

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions: int64 ``[num_tokens]`` -> final-norm hidden states."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[num_rows, vocab_size]`` for the rows the caller selected."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden_states, head.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the preallocated parameters.

        Raises ValueError on an unexpected name or when a parameter is left (partly) unloaded.
        """
        q_size = self.config.num_attention_heads * self.config.head_dim
        kv_size = self.config.num_key_value_heads * self.config.head_dim
        inter = self.config.intermediate_size
        fused_rows = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_size),
            "self_attn.k_proj": ("self_attn.qkv_proj", q_size, kv_size),
            "self_attn.v_proj": ("self_attn.qkv_proj", q_size + kv_size, kv_size),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        params = dict(self.named_parameters())
        rows_loaded = dict.fromkeys(params, 0)
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and self.lm_head is None
            ):
                continue
            parts = name.split(".")
            fused = fused_rows.get(".".join(parts[-3:-1]))
            if fused is None:
                target, start, num_rows = name, 0, None
            else:
                fused_name, start, num_rows = fused
                target = ".".join([*parts[:-3], fused_name, parts[-1]])
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            num_rows = param.shape[0] if num_rows is None else num_rows
            param.narrow(0, start, num_rows).copy_(tensor)
            rows_loaded[target] += num_rows
        missing = [name for name, rows in rows_loaded.items() if rows != params[name].shape[0]]
        if missing:
            raise ValueError(f"weights missing from checkpoint: {', '.join(missing)}")
