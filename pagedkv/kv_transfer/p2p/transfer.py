"""The data path's pieces: KV blocks packed by block table, cut into messages, scattered back.

D plans the messages, because only D knows where the blocks land: for each KV cache group it
cuts the wanted blocks into *segments* (sent in the WANT), at breaks in its own block ids
where the runs between them are long enough to be messages of their own, else packing short
runs together, never more than ``chunk_blocks`` blocks (``plan_segments_at_runs``); every
segment of every layer travels as two messages, its K half and its V half::

    layer 0: seg 0 K, seg 0 V, seg 1 K, seg 1 V, ...   layer 1: ...

Either side moves a message as a slice of its cache when its block ids for the message are
consecutive (zero copy: P sends from it, D receives into it), else through a reused staging
ring: P packs it, D scatters it, both with the compiled whole-block copy (block_copy.py; a
memcpy per run of blocks, the stores streamed past the caches); lanes.py.

Between instances of different tensor-parallel sizes a transfer may carry only some of the
KV heads of each block (a piece, head_plan.py): both sides then see their cache narrowed on
the head dimension (``narrow_heads``), a view that is not contiguous, so every message is
packed (torch's ``index_select`` of the heads) and scattered (``index_copy_`` into them):
``[n, block_size, heads of the piece, head_size]``. The same-TP path never narrows.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedkv.distributed.shard import Shard
from pagedkv.kv_transfer import block_copy

#: A run of blocks consecutive on D is a message of its own (received in place, no scatter)
#: from this many bytes per half (K or V); shorter runs are packed together. A gloo message
#: costs P and D ~80 us of CPU together (measured here, 2 loaded cores), about what
#: scattering 512 KiB costs D; when P's blocks are consecutive there too, no copy is left
#: (the bandwidth benchmark's "runs": 0.71 s of CPU per GiB against 0.98 packed).
MIN_RUN_BYTES = 1 << 19
#: Copies of at least this many bytes per thread made on the engine thread (PUT_ASYNC's
#: layers, GET's pool) use the forward's threads, which wait for the copy anyway.
PARALLEL_COPY_BYTES = 4 << 20


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[:, block_ids]`` as one contiguous tensor (a copy)."""
    out = torch.empty((2, len(block_ids), *cache.shape[2:]), dtype=cache.dtype)
    threads = min(torch.get_num_threads(), max(1, nbytes(out) // PARALLEL_COPY_BYTES))
    for kv in (0, 1):
        block_copy.gather(cache[kv], block_ids, out[kv], num_threads=threads)
    return out


def narrow_heads(cache: torch.Tensor, kv_heads: Shard | None, first_head: int) -> torch.Tensor:
    """A layer cache ``[2, num_blocks, block_size, heads, head_size]`` whose heads are the
    checkpoint's from ``first_head`` on, narrowed to the checkpoint's ``kv_heads`` (None, or
    all of them: the cache itself)."""
    if kv_heads is None or (kv_heads.start == first_head and kv_heads.size == cache.shape[3]):
        return cache
    return cache.narrow(3, kv_heads.start - first_head, kv_heads.size)


def block_bytes(cache: torch.Tensor) -> int:
    """Bytes of one block (K and V) of a layer cache ``[2, num_blocks, block_size, ...]``."""
    return cache[:, 0].numel() * cache.element_size()


def chunk_blocks_for(block_bytes: int, chunk_bytes: int) -> int:
    """Whole blocks per message (one K or V half): at most ``chunk_bytes``, at least one."""
    return max(1, chunk_bytes // max(1, block_bytes // 2))


def min_run_blocks_for(block_bytes: int, chunk_blocks: int) -> int:
    """Blocks from which a run consecutive on D is a message of its own (``MIN_RUN_BYTES``)."""
    return min(chunk_blocks, chunk_blocks_for(block_bytes, MIN_RUN_BYTES))


def plan_segments(num_blocks: int, chunk_blocks: int) -> list[int]:
    """Segment lengths for ``num_blocks`` blocks: chunks of ``chunk_blocks``, the last shorter."""
    return [min(chunk_blocks, num_blocks - s) for s in range(0, num_blocks, chunk_blocks)]


def runs(block_ids: Sequence[int]) -> list[int]:
    """Lengths of the maximal runs of consecutive ids in ``block_ids``, in order."""
    lengths: list[int] = []
    for i, block in enumerate(block_ids):
        if i and block == block_ids[i - 1] + 1:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


def plan_segments_at_runs(
    block_ids: Sequence[int], chunk_blocks: int, min_run_blocks: int
) -> list[int]:
    """Segment lengths for D's ``block_ids`` (wire order): each run of at least
    ``min_run_blocks`` consecutive ids is cut into near-equal segments of at most
    ``chunk_blocks`` (each received in place); the shorter runs between them are packed
    together into segments of ``chunk_blocks`` (staged and scattered), the last shorter."""
    segments: list[int] = []
    packed = 0  # blocks of short runs not yet cut into a segment
    for length in runs(block_ids):
        if length < min_run_blocks:
            packed += length
            while packed >= chunk_blocks:
                segments.append(chunk_blocks)
                packed -= chunk_blocks
            continue
        if packed:
            segments.append(packed)
            packed = 0
        pieces = -(-length // chunk_blocks)
        segments.extend(length // pieces + (i < length % pieces) for i in range(pieces))
    if packed:
        segments.append(packed)
    return segments


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
    #: Positions ``i`` where ``block_ids[i + 1] != block_ids[i] + 1``, ascending: computed
    #: on the first ``run``, so a message's check costs no tensor op.
    _breaks: list[int] | None = field(default=None, repr=False, compare=False)

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
        return (end - start) * math.prod(self.cache.shape[2:]) * self.cache.element_size()

    def run(self, kv: int, start: int, end: int) -> torch.Tensor | None:
        """The message's blocks as a slice of the cache when this side's ids for it are
        consecutive (zero copy) and the cache holds whole blocks (not narrowed), else None."""
        if not self.cache.is_contiguous():
            return None
        ids = self.block_ids.numpy()
        if self._breaks is None:
            self._breaks = np.flatnonzero(np.diff(ids) != 1).tolist()
        if start >= end or bisect_left(self._breaks, start) != bisect_left(self._breaks, end - 1):
            return None
        first = int(ids[start])
        return self.cache[kv, first : first + end - start]

    def gather(self, kv: int, start: int, end: int, out: torch.Tensor) -> None:
        """Pack message ``(kv, start, end)`` into ``out`` (its blocks in wire order)."""
        block_copy.gather(self.cache[kv], self.block_ids[start:end], out)

    def scatter(self, kv: int, start: int, end: int, message: torch.Tensor) -> None:
        """Write a received message into its blocks (the inverse of ``gather``)."""
        block_copy.scatter(self.cache[kv], self.block_ids[start:end], message)
