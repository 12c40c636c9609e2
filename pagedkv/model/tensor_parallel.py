"""ModelShards: the part of a Llama-family model one tensor-parallel rank holds (Megatron's
split, vLLM's layers).

- q/k/v and gate/up are column-parallel (vLLM's ``ColumnParallelLinear``): the rank's output
  features, its query heads (``even_shard``), KV heads (``kv_head_shard``: replicated when there
  are fewer than ranks) and intermediate features.
- o_proj and down_proj are row-parallel (``RowParallelLinear``): the rank's input features;
  their partial products are summed by one all-reduce each, and only rank 0 holds their bias,
  so it is added once.
- The embedding and LM head are vocabulary-parallel (``VocabParallelEmbedding``,
  ``ParallelLMHead``): the rank's rows of ``vocab_shard``, cut at ``vocab_size`` (the last
  rank may hold fewer; nothing past ``vocab_size`` exists to be sampled).

Each projection is a plain ``Linear`` (the head an ``LMHead``) of the local shape, and the
all-reduce after a row-parallel one is the layer's (``LlamaAttention``, ``LlamaMLP``): the
compiled CPU kernels and the kernel choices see only local shapes, the choices' timing runs
the module alone (no collective a rank would run on its own), and with one rank the model is
exactly the unsharded one. The loader copies each checkpoint tensor's part for this rank
(``CheckpointSlice``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedkv.distributed.shard import Shard, check_divides, even_shard, kv_head_shard, vocab_shard
from pagedkv.model.config import ModelConfig


class ModelShards(NamedTuple):
    """Rank ``tp_rank``'s ranges of the checkpoint's query heads, KV heads, intermediate
    features and vocabulary rows (``vocab`` cut at ``vocab_size``)."""

    q_heads: Shard
    kv_heads: Shard
    intermediate: Shard
    vocab: Shard

    @classmethod
    def of(cls, config: ModelConfig, tp_rank: int, tp_size: int) -> ModelShards:
        """Raises ValueError naming the field when ``tp_size`` ranks cannot share it."""
        size, rank = tp_size, tp_rank
        check_divides("num_attention_heads", config.num_attention_heads, size)
        check_divides("intermediate_size", config.intermediate_size, size)
        vocab = vocab_shard(config.vocab_size, rank, size)
        last = vocab_shard(config.vocab_size, size - 1, size)
        if last.start >= config.vocab_size:
            raise ValueError(
                f"tensor_parallel_size {size} is too large for vocab_size "
                f"({config.vocab_size}): its last rank would hold no vocabulary rows"
            )
        return cls(
            q_heads=even_shard(config.num_attention_heads, rank, size),
            kv_heads=kv_head_shard(config.num_key_value_heads, rank, size),
            intermediate=even_shard(config.intermediate_size, rank, size),
            vocab=Shard(vocab.start, min(vocab.end, config.vocab_size) - vocab.start),
        )


class CheckpointSlice(NamedTuple):
    """Where a checkpoint tensor goes: outputs ``[start, start + num_outputs)`` of parameter
    ``param`` (``num_outputs`` None: all of them), from rows ``shard`` of the ``total`` along
    the tensor's dimension ``dim`` (the checkpoint's layout, ``[out, in]``; ``shard`` None: the
    whole tensor)."""

    param: str
    start: int = 0
    num_outputs: int | None = None
    dim: int = 0
    shard: Shard | None = None
    total: int = 0

    def narrow(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (a view); ValueError when the tensor
        does not have ``total`` rows to take it from."""
        shard = self.shard
        if shard is None:
            return tensor
        if tensor.dim() <= self.dim or tensor.shape[self.dim] != self.total:
            expected = [*tensor.shape[: self.dim], self.total, *tensor.shape[self.dim + 1 :]]
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}"
            )
        return tensor.narrow(self.dim, shard.start, shard.size)
