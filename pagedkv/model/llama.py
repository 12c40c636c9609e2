"""The Llama family (Llama, Mistral, Qwen2): our layers over the paged KV cache.

q/k/v and gate/up projections are fused into one Linear each at load time: the checkpoint's
separate tensors are copied, transposed, into column ranges of the fused weight
(``load_weights``). With tied embeddings the LM head is a transposed copy of the embedding.

Tensor parallel: each rank builds its shard (``tensor_parallel.ModelShards``) and the loader
copies its part of each checkpoint tensor; o_proj and down_proj are followed by one all-reduce
each, the embedding by one more. Every rank then holds the same residual stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from pagedkv.attention import ForwardContext
from pagedkv.distributed.shard import Shard
from pagedkv.distributed.tp_group import SINGLE_RANK, TPGroup
from pagedkv.model.activation import SiluAndMul
from pagedkv.model.config import ModelConfig
from pagedkv.model.linear import Linear
from pagedkv.model.lm_head import LMHead
from pagedkv.model.rms_norm import RMSNorm
from pagedkv.model.rotary_embedding import RotaryEmbedding, apply_rotary_emb
from pagedkv.model.tensor_parallel import CheckpointSlice, ModelShards
from pagedkv.model.vocab_embedding import VocabParallelEmbedding

if TYPE_CHECKING:
    from pagedkv.model.cpu_decode_layer import CpuDecodeLayer
    from pagedkv.model.cpu_layer_ops import CpuLayerOps


class _LayerArgs(NamedTuple):
    """What every decoder layer is built from: the config, the biases the architecture has,
    and this rank's shard of the layer (``tp``: the group its row-parallel sums run over)."""

    config: ModelConfig
    qkv_bias: bool
    o_proj_bias: bool
    shards: ModelShards
    tp: TPGroup


class LlamaAttention(nn.Module):
    """This rank's query and KV heads: qkv_proj column-parallel, o_proj row-parallel (its bias
    on rank 0 only) followed by the all-reduce."""

    def __init__(self, args: _LayerArgs, layer_idx: int) -> None:
        super().__init__()
        config, tp = args.config, args.tp
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads = args.shards.q_heads.size
        self.num_kv_heads = args.shards.kv_heads.size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, args.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, args.o_proj_bias and tp.is_first)
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
        return self.tp.all_reduce(self.o_proj(out.view(num_tokens, self.q_size)))


class LlamaMLP(nn.Module):
    """This rank's intermediate features: gate_up_proj column-parallel, down_proj row-parallel
    (its bias on rank 0 only) followed by the all-reduce."""

    def __init__(self, args: _LayerArgs) -> None:
        super().__init__()
        config, tp = args.config, args.tp
        size = args.shards.intermediate.size
        self.tp = tp
        self.gate_up_proj = Linear(config.hidden_size, 2 * size, config.mlp_bias)
        self.down_proj = Linear(size, config.hidden_size, config.mlp_bias and tp.is_first)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act_fn(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: _LayerArgs, layer_idx: int) -> None:
        super().__init__()
        config = args.config
        self.self_attn = LlamaAttention(args, layer_idx)
        self.mlp = LlamaMLP(args)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        #: The whole layer for a step's one decoding token in one compiled call
        #: (``cpu_decode_layer.attach``; with several ranks only over shared memory, whose
        #: all-reduces it runs from C); None: module by module.
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
    def __init__(self, args: _LayerArgs) -> None:
        super().__init__()
        config = args.config
        self.embed_tokens = VocabParallelEmbedding(args.shards.vocab, config.hidden_size, args.tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(args, i) for i in range(config.num_hidden_layers)
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
    from the config (``ModelConfig.sliding_windows``).

    ``tp``: the model is rank ``tp.rank``'s shard (``ModelShards``); ValueError when
    ``tp.world_size`` cannot share the heads or the intermediate features."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.shards = ModelShards.of(config, tp.rank, tp.world_size)
        qkv_bias, o_proj_bias = self.attention_biases(config)
        self.model = LlamaModel(_LayerArgs(config, qkv_bias, o_proj_bias, self.shards, tp))
        #: This rank's vocabulary rows (vLLM's ``ParallelLMHead``; ``parallel_logits``).
        self.lm_head = LMHead(config.hidden_size, self.shards.vocab.size)

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
        """fp32 logits ``[num_rows, self.shards.vocab.size]`` for the rows the caller selected:
        this rank's columns of the vocabulary (all of it with one rank)."""
        return self.lm_head(hidden_states).float()

    def _checkpoint_target(self, name: str) -> CheckpointSlice | None:
        """Where checkpoint tensor ``name`` goes on this rank; None: on another rank only (the
        bias of a row-parallel projection, which rank 0 adds)."""
        config, shards, head_dim = self.config, self.shards, self.config.head_dim
        q = Shard(shards.q_heads.start * head_dim, shards.q_heads.size * head_dim)
        kv = Shard(shards.kv_heads.start * head_dim, shards.kv_heads.size * head_dim)
        q_total = config.num_attention_heads * head_dim
        kv_total = config.num_key_value_heads * head_dim
        inter, inter_total = shards.intermediate, config.intermediate_size
        column_parallel = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q, q_total),
            "self_attn.k_proj": ("self_attn.qkv_proj", q.size, kv, kv_total),
            "self_attn.v_proj": ("self_attn.qkv_proj", q.size + kv.size, kv, kv_total),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter, inter_total),
            "mlp.up_proj": ("mlp.gate_up_proj", inter.size, inter, inter_total),
        }
        row_parallel = {"self_attn.o_proj": (q, q_total), "mlp.down_proj": (inter, inter_total)}
        parts = name.split(".")
        module, kind = ".".join(parts[-3:-1]), parts[-1]
        if module in column_parallel:
            fused_name, start, shard, total = column_parallel[module]
            fused = ".".join([*parts[:-3], fused_name, kind])
            return CheckpointSlice(fused, start, shard.size, shard=shard, total=total)
        if module in row_parallel:
            if kind == "bias":
                return CheckpointSlice(name) if self.tp.is_first else None
            shard, total = row_parallel[module]
            return CheckpointSlice(name, dim=1, shard=shard, total=total)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return CheckpointSlice(name, shard=shards.vocab, total=config.vocab_size)
        return CheckpointSlice(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names), each narrowed to this rank's part, into
        the preallocated parameters.

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
            target = self._checkpoint_target(name)
            if target is None:
                continue
            param = params.get(target.param)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            output_dim = output_dims[target.param]
            num_outputs = target.num_outputs
            if num_outputs is None:
                num_outputs = param.shape[output_dim]
            destination = param.narrow(output_dim, target.start, num_outputs)
            if output_dim == 1:
                destination = destination.t()
            tensor = target.narrow(name, tensor)
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(destination.shape)} on this rank"
                )
            destination.copy_(tensor)
            outputs_loaded[target.param] += num_outputs
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
