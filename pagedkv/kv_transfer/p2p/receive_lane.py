"""ReceiveLane: D's side of a pair group's data path (see lanes.py for the whole).

Batches are received in the order their XFER_BEGINs arrived. Every message lands in a reused
staging ring, never straight in the paged cache, and is scattered into its load's blocks
under the load's lock only while the load is not cancelled: a load cancelled mid-transfer is
reported at once, and what P still sends for it drains into staging, so the lane stays in
step with P whatever D gave up on.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed import ProcessGroupGloo

from pagedkv.kv_transfer.p2p.lanes import Lane, LaneError
from pagedkv.kv_transfer.p2p.protocol import XferBegin
from pagedkv.kv_transfer.p2p.transfer import LayerBlocks, nbytes


class Target(Protocol):
    """A load being received: ``lock`` orders scatters against ``cancelled``."""

    lock: threading.Lock
    cancelled: bool


class StagingRing:
    """One reused staging buffer, handed out first in, first out: a message takes the next
    ``size`` bytes (wrapping to the start when the end is too short) and gives them back when
    its receive has completed and been scattered. At most ``capacity`` bytes (or one larger
    message) are ever allocated."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._buffer: torch.Tensor | None = None
        self._spans: deque[tuple[int, int]] = deque()  # (offset, size), oldest first

    def take(self, size: int) -> torch.Tensor | None:
        """``size`` bytes, or None until older messages give theirs back."""
        if self._buffer is None or self._buffer.numel() < size:
            if self._spans:
                return None
            self._buffer = torch.empty(max(self.capacity, size), dtype=torch.uint8)
        cap = self._buffer.numel()
        if not self._spans:
            start = 0
        else:
            first = self._spans[0][0]
            end = self._spans[-1][0] + self._spans[-1][1]
            if end > first:  # in use: [first, end)
                start = end if end + size <= cap else 0 if size <= first else -1
            else:  # wrapped, in use: [first, cap) and [0, end)
                start = end if end + size <= first else -1
            if start < 0:
                return None
        self._spans.append((start, size))
        return self._buffer[start : start + size]

    def give_back(self) -> None:
        """The oldest message's bytes are free again."""
        self._spans.popleft()

    def release(self) -> None:
        """Drop the buffer (nothing in use): the lane is idle."""
        assert not self._spans
        self._buffer = None


@dataclass(slots=True, eq=False)
class _Part:
    """One transfer of a received batch: where its messages go (``target`` None: drained)."""

    target: Target | None
    layers: list[LayerBlocks]
    num_bytes: int = 0


#: A message to receive: its part, its layer's blocks, (kv, start, end), the batch's gloo
#: tag, and whether it is its part's last.
_Message = tuple[_Part, LayerBlocks, int, int, int, int, bool]


class ReceiveLane(Lane):
    """D's side. ``resolve(transfer_id, segments)`` (called on the lane thread when a batch
    starts) gives a load's target and its layers, or None: the part drains into staging
    (``drain_layers`` sizes it). ``on_received(target, num_bytes, error)`` reports each
    resolved part once, after its last scatter or once the lane can't go on."""

    #: An idle lane keeps its staging buffer this long, then lets it go.
    IDLE_RELEASE_S = 2.0

    def __init__(
        self,
        pg: ProcessGroupGloo,
        peer_rank: int,
        resolve: Callable[[str, list[list[int]]], tuple[Target, list[LayerBlocks]] | None],
        drain_layers: Callable[[list[list[int]]], list[LayerBlocks]],
        on_received: Callable[[Target, int, Exception | None], None],
        on_broken: Callable[[str], None],
        in_flight_bytes: int,
        timeout_s: float,
        name: str,
    ) -> None:
        super().__init__(pg, peer_rank, on_broken, in_flight_bytes, timeout_s, name)
        self._resolve = resolve
        self._drain_layers = drain_layers
        self._on_received = on_received
        self._batches: deque[XferBegin] = deque()
        self._ring = StagingRing(in_flight_bytes)

    def submit(self, begin: XferBegin) -> bool:
        """Receive this batch after the ones submitted before it; False once stopped."""
        with self._cond:
            if self._stopped is not None:
                return False
            self._batches.append(begin)
            self._cond.notify_all()
            return True

    def _run(self) -> None:
        pending: deque[_Message] = deque()
        #: Posted receives, oldest first: (work, received view, message).
        window: deque[tuple[object, torch.Tensor, _Message]] = deque()
        posted = [0]
        try:
            while True:
                with self._cond:
                    while not self._batches and not pending and not window:
                        self._check_stopped()
                        if not self._cond.wait(self.IDLE_RELEASE_S):
                            self._ring.release()
                    self._check_stopped()
                    begins = list(self._batches)
                    self._batches.clear()
                for begin in begins:
                    self._plan(begin, pending)
                self._post(pending, window, posted)
                if window:
                    self._complete_oldest(window, posted)
        except Exception as e:
            reason = str(e)
            self._broke(reason)
            self._settle(work for work, _, _ in window)  # staging is reused only after
            error = e if isinstance(e, LaneError) else LaneError(reason)
            ended: set[int] = set()
            for part in [m[0] for m in pending] + [w[2][0] for w in window]:
                if part.target is not None and id(part) not in ended:
                    ended.add(id(part))
                    self._on_received(part.target, part.num_bytes, error)

    def _plan(self, begin: XferBegin, pending: deque[_Message]) -> None:
        parts = []
        for xfer in begin.parts:
            resolved = self._resolve(xfer.transfer_id, xfer.segments)
            if resolved is None:
                parts.append(_Part(None, self._drain_layers(xfer.segments)))
            else:
                parts.append(_Part(*resolved))
        order = [
            (part, part.layers[layer], kv, start, end)
            for layer in range(len(parts[0].layers) if parts else 0)
            for part in parts
            for kv, start, end in part.layers[layer].messages()
        ]
        last = {id(message[0]): n for n, message in enumerate(order)}
        for n, (part, blocks, kv, start, end) in enumerate(order):
            pending.append((part, blocks, kv, start, end, begin.tag, last[id(part)] == n))
        for part in parts:  # nothing to receive: done at once
            if id(part) not in last and part.target is not None:
                self._on_received(part.target, 0, None)

    def _post(self, pending: deque[_Message], window: deque, posted: list[int]) -> None:
        while pending:
            message = pending[0]
            _, blocks, _, start, end, tag, _ = message
            shape = (end - start, *blocks.cache.shape[2:])
            size = shape[0] * blocks.cache[0, 0].numel() * blocks.cache.element_size()
            if window and posted[0] + size > self._in_flight_bytes:
                return
            self._check_stopped()
            staging = self._ring.take(size)
            if staging is None:
                return
            view = staging.view(blocks.cache.dtype).view(shape)
            assert self._pg is not None
            work = self._pg.recv([view], self._peer_rank, tag)
            pending.popleft()
            window.append((work, view, message))
            posted[0] += size

    def _complete_oldest(self, window: deque, posted: list[int]) -> None:
        work, view, (part, blocks, kv, start, end, _, last) = window[0]
        self._wait(work)
        window.popleft()
        size = nbytes(view)
        posted[0] -= size
        if part.target is not None:
            with part.target.lock:
                if not part.target.cancelled:
                    blocks.scatter(kv, start, end, view)
            part.num_bytes += size
            if last:
                self._on_received(part.target, part.num_bytes, None)
        self._ring.give_back()
