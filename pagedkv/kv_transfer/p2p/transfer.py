"""The data path's pieces: KV blocks packed by block table, cut into messages, scattered back.

D plans the messages, because only D knows where the blocks land: for each KV cache group it
cuts the wanted blocks into *segments* of at most ``chunk_blocks`` blocks (sent in the WANT);
every segment of every layer travels as two messages, its K half and its V half::

    layer 0: seg 0 K, seg 0 V, seg 1 K, seg 1 V, ...   layer 1: ...

P packs a message with ``index_select`` of its block ids, or, when its ids for the message are
consecutive and the blocks stay put until the send completes, sends the cache slice itself
(zero copy). D receives every message into a staging buffer of its receive lane and scatters
it into its blocks (``index_copy_``, or ``copy_`` when its ids for the message are
consecutive): nothing is ever received straight into the paged cache, so a load cancelled
mid-transfer stops being written at once (lanes.py).
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

    def pack(self, kv: int, start: int, end: int, copy: bool) -> torch.Tensor:
        """Message ``(kv, start, end)``: ``[n, block_size, heads, head_size]``, contiguous.
        ``copy=False`` may return a view of the cache (only while the blocks stay put)."""
        half = self.cache[kv]
        first = consecutive_start(self.block_ids[start:end])
        if first is not None:
            view = half[first : first + end - start]
            return view.clone() if copy else view
        return _as_words(half).index_select(0, self.block_ids[start:end]).view(half.dtype)

    def scatter(self, kv: int, start: int, end: int, message: torch.Tensor) -> None:
        """Write a received message into its blocks (the inverse of ``pack``)."""
        half = self.cache[kv]
        ids = self.block_ids[start:end]
        first = consecutive_start(ids)
        if first is not None:
            half[first : first + end - start].copy_(message)
        else:
            _as_words(half).index_copy_(0, ids, _as_words(message))
