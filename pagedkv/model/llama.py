"""The Llama family (Llama, Mistral, Qwen2): our layers over the paged KV cache.

q/k/v and gate/up projections are fused into one Linear each at load time: the checkpoint's
separate tensors are copied, transposed, into column ranges of the fused weight
(``load_weights``). With tied embeddings the LM head is a transposed copy of the embedding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedkv.attention import ForwardContext
from pagedkv.model.activation import SiluAndMul
from pagedkv.model.config import ModelConfig
from pagedkv.model.linear import Linear
from pagedkv.model.lm_head import LMHead
from pagedkv.model.rms_norm import RMSNorm
from pagedkv.model.rotary_embedding import RotaryEmbedding, apply_rotary_emb
from pagedkv.model.vocab_embedding import VocabEmbedding

if TYPE_CHECKING:
    from pagedkv.model.cpu_decode_layer import CpuDecodeLayer
    from pagedkv.model.cpu_layer_ops import CpuLayerOps


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
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, o_proj_bias)
        #: The compiled fp32 CPU ops (``cpu_layer_ops.attach``): RoPE and the cache write in one
        #: call; None: torch ops and the backend's ``reshape_and_cache``.
        self.cpu_ops: CpuLayerOps | None = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        kv_cache = ctx.kv_caches[self.layer_idx]
        metadata = ctx.attn_metadata[self.layer_idx]
        connector = ctx.kv_connector
        if connector is not None:
            connector.wait_for_layer_load(self.layer_idx)
        if self.cpu_ops is not None:
            query = self.cpu_ops.rotary_and_cache(
                qkv, cos, signed_sin, kv_cache, metadata.slot_mapping, self.num_heads
            )
        else:
            qk_size = self.q_size + self.kv_size
            # q and k are adjacent in the fused output: one rotary call covers both.
            qk = apply_rotary_emb(
                qkv[:, :qk_size].view(num_tokens, -1, self.head_dim), cos, signed_sin
            )
            query, key = qk[:, : self.num_heads], qk[:, self.num_heads :]
            value = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
            ctx.backend.reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        if connector is not None:
            connector.save_kv_layer(self.layer_idx, kv_cache, metadata)
        out = ctx.backend.forward(query, kv_cache, metadata, self.scaling)
        return self.o_proj(out.view(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * size, config.mlp_bias)
        self.down_proj = Linear(size, config.hidden_size, config.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, qkv_bias: bool, o_proj_bias: bool
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, qkv_bias, o_proj_bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        #: The whole layer for a step's one decoding token in one compiled call
        #: (``cpu_decode_layer.attach``); None: module by module.
        self.cpu_decode: CpuDecodeLayer | None = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual stream: returns ``(mlp output, residual)``, whose sum is the layer's
        output; the next norm adds them (``residual`` None: the first layer)."""
        one_call = self.cpu_decode
        if one_call is not None and ctx.kv_connector is None:
            layer_idx = self.self_attn.layer_idx
            metadata = ctx.attn_metadata[layer_idx]
            if one_call.applies(hidden_states, metadata):
                kv_cache = ctx.kv_caches[layer_idx]
                return one_call(hidden_states, residual, cos, signed_sin, kv_cache, metadata)
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos, signed_sin, ctx)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, o_proj_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
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
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, cos, signed_sin, ctx)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Also serves ``MistralForCausalLM``: same weights, and the per-layer sliding windows come
    from the config (``ModelConfig.sliding_windows``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        qkv_bias, o_proj_bias = self.attention_biases(config)
        self.model = LlamaModel(config, qkv_bias, o_proj_bias)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)

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
        return self.lm_head(hidden_states).float()

    def _checkpoint_target(self, name: str) -> tuple[str, int, int | None]:
        """Where checkpoint tensor ``name`` goes: ``(parameter, first output, num outputs)``;
        ``num outputs`` is None when the tensor fills the whole parameter."""
        q_size = self.config.num_attention_heads * self.config.head_dim
        kv_size = self.config.num_key_value_heads * self.config.head_dim
        inter = self.config.intermediate_size
        fused_shards = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_size),
            "self_attn.k_proj": ("self_attn.qkv_proj", q_size, kv_size),
            "self_attn.v_proj": ("self_attn.qkv_proj", q_size + kv_size, kv_size),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        parts = name.split(".")
        shard = fused_shards.get(".".join(parts[-3:-1]))
        if shard is None:
            return name, 0, None
        fused_name, start, num_outputs = shard
        return ".".join([*parts[:-3], fused_name, parts[-1]]), start, num_outputs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the preallocated parameters.

        Raises ValueError on an unexpected name or shape, or when a parameter is left (partly)
        unloaded.
        """
        params = dict(self.named_parameters())
        # Linear weights are [in, out]: the checkpoint's rows (output features) are their columns.
        output_dims = {name: 0 for name in params} | {
            f"{name}.weight": 1
            for name, module in self.named_modules()
            if isinstance(module, Linear)
        }
        outputs_loaded = dict.fromkeys(params, 0)
        tied = self.config.tie_word_embeddings
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                continue
            target, start, num_outputs = self._checkpoint_target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            output_dim = output_dims[target]
            if num_outputs is None:
                num_outputs = param.shape[output_dim]
            destination = param.narrow(output_dim, start, num_outputs)
            if output_dim == 1:
                destination = destination.t()
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(destination.shape)}"
                )
            destination.copy_(tensor)
            outputs_loaded[target] += num_outputs
        if tied:
            params["lm_head.weight"].copy_(params["model.embed_tokens.weight"].t())
            outputs_loaded["lm_head.weight"] = outputs_loaded["model.embed_tokens.weight"]
        missing = [
            name
            for name, param in params.items()
            if outputs_loaded[name] != param.shape[output_dims[name]]
        ]
        if missing:
            raise ValueError(f"weights missing from checkpoint: {', '.join(missing)}")
        self.lm_head.prepare()
