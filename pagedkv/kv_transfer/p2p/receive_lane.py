"""ReceiveLane: D's side of a pair group's data path (see lanes.py for the whole).

Batches are received in the order their XFER_BEGINs arrived. A message whose blocks are
consecutive on D is received straight into them; any other lands in a reused staging ring and
is scattered (``index_copy_``) under the load's lock while the next ones arrive. Once a load
is cancelled nothing more is posted into or scattered into its blocks, and its end is
reported as soon as no receive posted into them is left (at once, unless one was in
flight): what P still sends for it drains into staging, so the lane stays in step with P
whatever D gave up on.
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
    """A load being received. Under ``lock``: ``cancelled`` (nothing more may land in its
    blocks) and ``posted`` (receives posted straight into its blocks, still in flight)."""

    lock: threading.Lock
    cancelled: bool
    posted: int


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
    (``drain_layers`` sizes it). ``on_received(target, num_bytes, error)``: a resolved
    part's last message is in (error None), or the lane can't go on, or a cancelled part's
    last receive posted into its blocks has ended (the same part may be told more than once:
    only the first end counts)."""

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
        #: Posted receives, oldest first: (work, where it lands, straight into the blocks?,
        #: message).
        window: deque[tuple[object, torch.Tensor, bool, _Message]] = deque()
        posted = [0]
        try:
            while True:
                with self._cond:
                    while not self._batches and not pending and not window:
                        self._check_stopped()
                        self._idle_wait()
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
            self._settle(entry[0] for entry in window)  # memory is reused only after
            for _, _, direct, (part, *_) in window:
                if direct:
                    assert part.target is not None
                    with part.target.lock:
                        part.target.posted -= 1
            error = e if isinstance(e, LaneError) else LaneError(reason)
            ended: set[int] = set()
            for part in [m[0] for m in pending] + [w[3][0] for w in window]:
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
            part, blocks, kv, start, end, tag, _ = message
            size = blocks.num_bytes(start, end)
            if window and posted[0] + size > self._in_flight_bytes:
                return
            self._check_stopped()
            into = self._into_blocks(part.target, blocks, kv, start, end)
            direct = into is not None
            if into is None:  # staged, scattered once it has arrived
                staging = self._ring.take(size)
                if staging is None:
                    return
                into = staging.view(blocks.cache.dtype).view(blocks.shape(start, end))
            assert self._pg is not None
            work = self._pg.recv([into], self._peer_rank, tag)
            pending.popleft()
            window.append((work, into, direct, message))
            posted[0] += size

    @staticmethod
    def _into_blocks(target: Target | None, blocks: LayerBlocks, kv: int, start: int, end: int):
        """The message's blocks themselves when D's ids for it are consecutive and the load
        is still wanted (counted in ``posted``: its end is reported once none is left)."""
        if target is None:
            return None
        run = blocks.run(kv, start, end)
        if run is None:
            return None
        with target.lock:
            if target.cancelled:
                return None
            target.posted += 1
        return run

    def _complete_oldest(self, window: deque, posted: list[int]) -> None:
        work, into, direct, (part, blocks, kv, start, end, _, last) = window[0]
        self._wait(work)
        window.popleft()
        size = nbytes(into)
        posted[0] -= size
        target = part.target
        if direct:
            assert target is not None
            with target.lock:
                target.posted -= 1
                released = target.cancelled and target.posted == 0
            if released:  # cancelled meanwhile: its end can be reported now
                self._on_received(target, part.num_bytes, LaneError("cancelled"))
        else:
            if target is not None:
                with target.lock:
                    if not target.cancelled:
                        blocks.scatter(kv, start, end, into)
            self._ring.give_back()
        if target is not None:
            part.num_bytes += size
            if last:
                self._on_received(target, part.num_bytes, None)
