"""Which part of a tensor-parallel model each rank holds (Megatron's split, vLLM's rules).

- Attention heads, the MLP's intermediate features: ``total / tp_size`` each, in rank order;
  ``total`` must divide (``check_divides``).
- KV heads: split the same way when there are at least ``tp_size`` of them; with fewer, each
  rank holds one head and every head is replicated ``tp_size / num_kv_heads`` times (vLLM's
  rule: rank ``r`` holds head ``r * num_kv_heads // tp_size``), so ``tp_size`` must then be a
  multiple of ``num_kv_heads``.
- The vocabulary: ``cdiv(vocab_size, tp_size)`` rows each; the last rank's range may end past
  ``vocab_size`` (its padding rows embed to zero and score ``-inf``).
"""

from __future__ import annotations

from typing import NamedTuple

from pagedkv.utils import cdiv


class Shard(NamedTuple):
    """Rows ``[start, start + size)`` of a dimension of length ``total``."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


def check_divides(name: str, total: int, tp_size: int) -> None:
    """ValueError naming ``name`` when ``tp_size`` ranks cannot share ``total`` equally."""
    if total % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide {name} ({total}): each rank holds "
            f"an equal share"
        )


def even_shard(total: int, tp_rank: int, tp_size: int) -> Shard:
    """Rank ``tp_rank``'s equal share of ``total`` (which ``tp_size`` divides)."""
    size = total // tp_size
    return Shard(tp_rank * size, size)


def kv_head_shard(num_kv_heads: int, tp_rank: int, tp_size: int) -> Shard:
    """The KV heads rank ``tp_rank`` holds (a range of the checkpoint's heads)."""
    if num_kv_heads >= tp_size:
        check_divides("the number of KV heads", num_kv_heads, tp_size)
        return even_shard(num_kv_heads, tp_rank, tp_size)
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must be a multiple of the number of KV heads "
            f"({num_kv_heads}) when it exceeds it: each KV head is then replicated"
        )
    return Shard(tp_rank * num_kv_heads // tp_size, 1)


def vocab_shard(vocab_size: int, tp_rank: int, tp_size: int) -> Shard:
    """Rank ``tp_rank``'s rows of the embedding and LM head: ``cdiv(vocab, tp)`` each (the
    last range may end past ``vocab_size``)."""
    size = cdiv(vocab_size, tp_size)
    return Shard(tp_rank * size, size)


class TPLayout(NamedTuple):
    """A rank's place in its instance's tensor-parallel group, as its KV connector sees it:
    ``rank`` of ``size``, and the checkpoint's number of KV heads (``kv_heads``: the ones this
    rank's cache holds). ``SINGLE_LAYOUT``: one rank holding every head."""

    rank: int = 0
    size: int = 1
    #: The checkpoint's KV heads (0 with one rank: "all of them", however many).
    num_kv_heads: int = 0

    def kv_heads(self) -> Shard:
        return kv_head_shard(self.num_kv_heads, self.rank, self.size)


SINGLE_LAYOUT = TPLayout()
