"""RankHeads: which of the checkpoint's KV heads a tensor-parallel rank holds, writes and reads.

Stored KV is kept per KV head (``block_codec.head_key``): a value holds one head of one block,
keyed by the checkpoint's head index, so the keys do not depend on the writer's TP size. Every
rank of an instance of any TP size therefore writes and reads the same values:

- a rank **reads** every head its cache holds (``held``);
- a rank **writes** the heads it holds unless a lower rank holds them too (with fewer KV heads
  than ranks a head is replicated; its lowest holder alone writes it), so the ranks of one
  instance write each head of a block exactly once;
- a block is stored once every one of its ``num_kv_heads`` heads is (the scheduler half's
  lookup checks each head's key).

With one rank (``SINGLE_LAYOUT``) the rank holds and writes every head of its cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.distributed.shard import Shard, TPLayout, kv_head_shard


def checkpoint_kv_heads(tp: TPLayout, local_heads: int) -> int:
    """The checkpoint's KV heads: ``tp.num_kv_heads``, or with none named (one rank), the
    ``local_heads`` a rank's cache (or KV cache spec) holds."""
    return tp.num_kv_heads or local_heads


@dataclass(frozen=True, slots=True)
class RankHeads:
    #: The checkpoint's KV heads.
    num_kv_heads: int
    #: The heads this rank's cache holds (its local heads ``0..held.size-1``, in order).
    held: Shard
    #: Whether this rank writes ``held`` (False: a lower rank holds the same head).
    writes: bool

    @classmethod
    def of(cls, tp: TPLayout, local_heads: int) -> RankHeads:
        """Rank ``tp.rank``'s heads; ``local_heads``: the heads its cache holds (checked)."""
        num_kv_heads = checkpoint_kv_heads(tp, local_heads)
        held = kv_head_shard(num_kv_heads, tp.rank, tp.size)
        if held.size != local_heads:
            raise ValueError(
                f"rank {tp.rank} of {tp.size} holds {held.size} of {num_kv_heads} KV heads, "
                f"but its KV cache has {local_heads}"
            )
        lowest = next(r for r in range(tp.size) if kv_head_shard(num_kv_heads, r, tp.size) == held)
        return cls(num_kv_heads, held, writes=lowest == tp.rank)

    @property
    def written(self) -> range:
        """The checkpoint's heads this rank writes."""
        return range(self.held.start, self.held.end) if self.writes else range(0)

    @property
    def read(self) -> range:
        """The checkpoint's heads this rank reads: all it holds."""
        return range(self.held.start, self.held.end)
