"""The data path's pieces: KV blocks packed by block table, cut into messages, scattered back.

D plans the messages, because only D knows where the blocks land: for each KV cache group it
cuts the wanted blocks into *segments* of at most ``chunk_blocks`` blocks (sent in the WANT);
every segment of every layer travels as two messages, its K half and its V half::

    layer 0: seg 0 K, seg 0 V, seg 1 K, seg 1 V, ...   layer 1: ...

Either side moves a message as a slice of its cache when its block ids for the message are
consecutive (zero copy: P sends from it, D receives into it), else through a reused staging
ring (P packs with ``index_select``, D scatters with ``index_copy_``); lanes.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


def _as_words(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes viewed as 8-byte words when the innermost dimension allows: index_copy_
    and index_select move fp16/bf16 rows ~1.6x faster as int64 (fewer, wider elements)."""
    if tensor.element_size() < 8 and (tensor.shape[-1] * tensor.element_size()) % 8 == 0:
        try:
            return tensor.view(torch.int64)
        except RuntimeError:  # an odd storage offset or stride: keep the element view
            return tensor
    return tensor


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[:, block_ids]`` as one contiguous tensor (a copy)."""
    return _as_words(cache).index_select(1, block_ids).view(cache.dtype)


def block_bytes(cache: torch.Tensor) -> int:
    """Bytes of one block (K and V) of a layer cache ``[2, num_blocks, block_size, ...]``."""
    return cache[:, 0].numel() * cache.element_size()


def chunk_blocks_for(block_bytes: int, chunk_bytes: int) -> int:
    """Whole blocks per message (one K or V half): at most ``chunk_bytes``, at least one."""
    return max(1, chunk_bytes // max(1, block_bytes // 2))


def plan_segments(num_blocks: int, chunk_blocks: int) -> list[int]:
    """Segment lengths for ``num_blocks`` blocks: chunks of ``chunk_blocks``, the last shorter."""
    return [min(chunk_blocks, num_blocks - s) for s in range(0, num_blocks, chunk_blocks)]


def consecutive_start(block_ids: torch.Tensor) -> int | None:
    """The first id when ``block_ids`` are consecutive (a run), else None."""
    first = int(block_ids[0])
    n = len(block_ids)
    if int(block_ids[-1]) - first != n - 1:
        return None
    if n > 2 and not bool((block_ids[1:] - block_ids[:-1] == 1).all()):
        return None
    return first


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(slots=True)
class LayerBlocks:
    """One layer's share of a transfer on one side: its cache (or a copy), this side's block
    ids in wire order, and the segments (one K and one V message each)."""

    cache: torch.Tensor
    block_ids: torch.Tensor  # int64
    segments: list[int]

    def messages(self) -> Iterator[tuple[int, int, int]]:
        """``(kv, start, end)`` over ``block_ids``, in wire order."""
        start = 0
        for n in self.segments:
            yield 0, start, start + n
            yield 1, start, start + n
            start += n

    def shape(self, start: int, end: int) -> tuple[int, ...]:
        """Message ``(kv, start, end)``'s shape: ``[n, block_size, heads, head_size]``."""
        return (end - start, *self.cache.shape[2:])

    def num_bytes(self, start: int, end: int) -> int:
        return (end - start) * self.cache[0, 0].numel() * self.cache.element_size()

    def run(self, kv: int, start: int, end: int) -> torch.Tensor | None:
        """The message's blocks as a slice of the cache when this side's ids for it are
        consecutive (zero copy), else None."""
        first = consecutive_start(self.block_ids[start:end])
        return None if first is None else self.cache[kv, first : first + end - start]

    def gather(self, kv: int, start: int, end: int, out: torch.Tensor) -> None:
        """Pack message ``(kv, start, end)`` into ``out`` (index_select by block id)."""
        torch.index_select(
            _as_words(self.cache[kv]), 0, self.block_ids[start:end], out=_as_words(out)
        )

    def scatter(self, kv: int, start: int, end: int, message: torch.Tensor) -> None:
        """Write a received message into its blocks (the inverse of ``gather``)."""
        view = self.run(kv, start, end)
        if view is not None:
            view.copy_(message)
        else:
            ids = self.block_ids[start:end]
            _as_words(self.cache[kv]).index_copy_(0, ids, _as_words(message))
