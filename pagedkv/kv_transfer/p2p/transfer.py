"""The data path: KV blocks packed by block table, cut into messages, pipelined over gloo.

D plans the messages, because only D knows where the blocks land. For each KV cache group it
cuts the wanted blocks into *segments* (sent in the WANT); every segment of every layer travels
as two messages, its K half and its V half, in order::

    layer 0: seg 0 K, seg 0 V, seg 1 K, seg 1 V, ...   layer 1: ...   (one gloo tag)

    direct (D's blocks form runs):   segments = D's runs of consecutive block ids, cut at
        chunk_blocks. D receives each message straight into ``cache[kv, first:first + n]``:
        no staging buffer, no scatter.
    staged (D's blocks are scattered): segments = chunk_blocks each. D receives into a staging
        buffer and scatters it with ``index_copy_``.

P packs each message with ``index_select`` of its block ids, or, when its own ids for the
message are consecutive and the blocks stay put until the send completes, sends the cache
slice itself (zero copy). Up to ``in_flight_bytes`` of messages are in flight each way (gloo's
per-message latency is hidden by many small messages or a few large ones): P packs message
i+1 while message i is on the wire, D scatters i while i+1 arrives. Every wait has a
timeout. Received bytes land in D's blocks only while the transfer is not cancelled (checked
under the guard's lock when a receive is posted and before a scatter); the caller reports the
load ended only once this function has returned, i.e. once no posted receive can still write.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed import ProcessGroupGloo


class WriteGuard(Protocol):
    """Whether received bytes may still go into the paged cache (see the module docstring)."""

    lock: threading.Lock
    cancelled: bool


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


def runs(block_ids: list[int]) -> list[int]:
    """Lengths of the maximal runs of consecutive ids: [4, 5, 6, 9, 2, 3] -> [3, 1, 2]."""
    lengths: list[int] = []
    for i, block_id in enumerate(block_ids):
        if i and block_id == block_ids[i - 1] + 1:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


def plan_segments(block_ids: list[int], chunk_blocks: int, direct: bool) -> list[int]:
    """Segment lengths for one group's destination ids: runs cut at ``chunk_blocks`` (direct)
    or plain chunks (staged)."""
    pieces = runs(block_ids) if direct else [len(block_ids)] if block_ids else []
    return [min(chunk_blocks, n - s) for n in pieces for s in range(0, n, chunk_blocks)]


@dataclass(slots=True)
class LayerBlocks:
    """One layer's share of a transfer on one side: its cache (or pooled copy), this side's
    block ids in wire order, and the segments (one K and one V message each)."""

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

    def run_start(self, start: int, end: int) -> int | None:
        """The first id when ``block_ids[start:end]`` are consecutive, else None."""
        ids = self.block_ids[start:end]
        first = int(ids[0])
        if int(ids[-1]) - first != end - start - 1:
            return None
        if end - start > 2 and not bool((ids[1:] - ids[:-1] == 1).all()):
            return None
        return first

    def pack(self, kv: int, start: int, end: int, copy: bool) -> torch.Tensor:
        """Message ``(kv, start, end)``: ``[n, block_size, heads, head_size]``, contiguous.
        ``copy=False`` may return a view of the cache (only while the blocks stay put)."""
        half = self.cache[kv]
        first = self.run_start(start, end)
        if first is not None:
            view = half[first : first + end - start]
            return view.clone() if copy else view
        return _as_words(half).index_select(0, self.block_ids[start:end]).view(half.dtype)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class BlockSender:
    """Sends messages with up to ``in_flight_bytes`` of gloo sends outstanding."""

    def __init__(
        self, pg: ProcessGroupGloo, dst_rank: int, tag: int, in_flight_bytes: int, timeout_s: float
    ) -> None:
        self._pg = pg
        self._dst = dst_rank
        self._tag = tag
        self._in_flight_bytes = in_flight_bytes
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._window: deque[tuple[object, torch.Tensor]] = deque()
        self._window_bytes = 0
        self.num_bytes = 0

    @staticmethod
    def pack_all(layer: LayerBlocks, copy: bool) -> Iterator[torch.Tensor]:
        for kv, start, end in layer.messages():
            yield layer.pack(kv, start, end, copy)

    def send_layer(self, layer: LayerBlocks) -> None:
        """From blocks that stay put until ``finish``: runs go out without a copy."""
        for message in self.pack_all(layer, copy=False):
            self.send(message)

    def send(self, message: torch.Tensor) -> None:
        size = _nbytes(message)
        while self._window and self._window_bytes + size > self._in_flight_bytes:
            self._wait_oldest()
        work = self._pg.send([message], self._dst, self._tag)
        self._window.append((work, message))  # the tensor must live until its send completes
        self._window_bytes += size
        self.num_bytes += size

    def _wait_oldest(self) -> None:
        work, message = self._window.popleft()
        self._window_bytes -= _nbytes(message)
        work.wait(self._timeout)  # type: ignore[attr-defined]

    def finish(self) -> None:
        """Block until every message has left (raises if one failed or timed out)."""
        while self._window:
            self._wait_oldest()


def receive_layers(
    pg: ProcessGroupGloo,
    src_rank: int,
    tag: int,
    layers: list[LayerBlocks],
    direct: bool,
    in_flight_bytes: int,
    timeout_s: float,
    guard: WriteGuard,
    deadline: float | None = None,
) -> int:
    """Receive a whole transfer into the layers' caches. Returns the bytes received; raises on
    failure. After ``guard.cancelled`` is set, messages drain into staging and are dropped.
    Each wait lasts at most ``timeout_s``, and none goes past ``deadline`` (monotonic)."""
    messages = [(layer, kv, start, end) for layer in layers for kv, start, end in layer.messages()]
    if not messages:
        return 0
    ref = layers[0].cache
    max_elems = max(layer.cache[0, :1].numel() * max(layer.segments, default=0) for layer in layers)
    #: Staging buffers are made as needed (none when every message goes direct), then reused.
    staging: list[torch.Tensor] = []
    num_staging_left = max(2, in_flight_bytes // (max_elems * ref.element_size()))
    in_flight: deque[tuple[object, torch.Tensor, torch.Tensor | None, tuple]] = deque()
    posted_bytes = num_bytes = next_message = 0
    while next_message < len(messages) or in_flight:
        while next_message < len(messages):
            layer, kv, start, end = messages[next_message]
            shape = (end - start, *layer.cache.shape[2:])
            size = torch.Size(shape).numel() * ref.element_size()
            if in_flight and posted_bytes + size > in_flight_bytes:
                break
            with guard.lock:
                first = layer.run_start(start, end) if direct and not guard.cancelled else None
            buffer = None
            if first is not None:
                target = layer.cache[kv, first : first + end - start]
            elif staging or num_staging_left:
                if not staging:
                    num_staging_left -= 1
                    staging.append(torch.empty(max_elems, dtype=ref.dtype, device=ref.device))
                buffer = staging.pop()
                target = buffer[: torch.Size(shape).numel()].view(shape)
            else:
                break  # every staging buffer is in flight
            work = pg.recv([target], src_rank, tag)
            in_flight.append((work, target, buffer, messages[next_message]))
            posted_bytes += size
            next_message += 1
        work, target, buffer, (layer, kv, start, end) = in_flight.popleft()
        wait_s = timeout_s if deadline is None else min(timeout_s, deadline - time.monotonic())
        work.wait(datetime.timedelta(seconds=max(wait_s, 0.001)))  # type: ignore[attr-defined]
        if buffer is not None:
            with guard.lock:
                if not guard.cancelled:
                    half = _as_words(layer.cache[kv])
                    half.index_copy_(0, layer.block_ids[start:end], _as_words(target))
            staging.append(buffer)
        posted_bytes -= _nbytes(target)
        num_bytes += _nbytes(target)
    return num_bytes
