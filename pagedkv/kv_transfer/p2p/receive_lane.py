"""ReceiveLane: D's side of a pair group's data path (see lanes.py for the whole).

Batches are received in the order their XFER_BEGINs arrived. A message whose blocks are
consecutive on D is received straight into them; any other lands in a reused staging ring and
is scattered (the compiled block copy) under the load's lock while the next ones arrive. Once a load
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
from typing import NamedTuple, Protocol

import torch

from pagedkv.kv_transfer.p2p.lanes import Lane, LaneError
from pagedkv.kv_transfer.p2p.protocol import XferBegin, XferPart
from pagedkv.kv_transfer.p2p.transfer import LayerBlocks, nbytes
from pagedkv.kv_transfer.p2p.wire import GlooWire, Wire


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


class _Message(NamedTuple):
    """A message to receive: K or V (``kv``) of blocks ``[start, end)`` of one layer of one
    part, under the batch's gloo ``tag``; ``last``: its part's last message."""

    part: _Part
    blocks: LayerBlocks
    kv: int
    start: int
    end: int
    tag: int
    last: bool


class ReceiveLane(Lane):
    """D's side. ``resolve(part)`` (called on the lane thread when a batch starts) gives a
    load's target and its layers, or None: the part drains into staging (``drain_layers``
    sizes it). ``on_received(target, num_bytes, error)``: a resolved
    part's last message is in (error None), or the lane can't go on, or a cancelled part's
    last receive posted into its blocks has ended (the same part may be told more than once:
    only the first end counts)."""

    def __init__(
        self,
        wire: Wire,
        resolve: Callable[[XferPart], tuple[Target, list[LayerBlocks]] | None],
        drain_layers: Callable[[XferPart], list[LayerBlocks]],
        on_received: Callable[[Target, int, Exception | None], None],
        on_broken: Callable[[str], None],
        in_flight_bytes: int,
        timeout_s: float,
        name: str,
    ) -> None:
        super().__init__(wire, on_broken, in_flight_bytes, timeout_s, name)
        self._resolve = resolve
        self._drain_layers = drain_layers
        self._on_received = on_received
        self._batches: deque[XferBegin] = deque()
        #: Messages of the planned batches, in order, not yet posted.
        self._pending: deque[_Message] = deque()

    def submit(self, begin: XferBegin) -> bool:
        """Receive this batch after the ones submitted before it; False once stopped."""
        with self._cond:
            if self._stopped is not None:
                return False
            self._batches.append(begin)
            self._cond.notify_all()
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._batches and not self._pending and not self._window:
                    self._check_stopped()
                    self._idle_wait()
                self._check_stopped()
                begins = list(self._batches)
                self._batches.clear()
            for begin in begins:
                self._plan(begin)
            self._post_pending()
            if self._window:
                self._complete_oldest()

    def _fail(self, error: LaneError) -> None:
        for op in self._window:
            if not op.staged:
                target = op.then.part.target
                with target.lock:
                    target.posted -= 1
        ended: set[int] = set()
        for message in [*self._pending, *(op.then for op in self._window)]:
            part = message.part
            if part.target is not None and id(part) not in ended:
                ended.add(id(part))
                self._on_received(part.target, part.num_bytes, error)
        self._pending.clear()

    def _plan(self, begin: XferBegin) -> None:
        parts = []
        for xfer in begin.parts:
            resolved = self._resolve(xfer)
            if resolved is None:
                parts.append(_Part(None, self._drain_layers(xfer)))
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
            message = _Message(part, blocks, kv, start, end, begin.tag, last[id(part)] == n)
            self._pending.append(message)
        for part in parts:  # nothing to receive: done at once
            if id(part) not in last and part.target is not None:
                self._on_received(part.target, 0, None)

    def _post_pending(self) -> None:
        while self._pending:
            message = self._pending[0]
            blocks, start, end = message.blocks, message.start, message.end
            size = blocks.num_bytes(start, end)
            if self._window and self._window_bytes + size > self._in_flight_bytes:
                return
            self._check_stopped()
            into = self._into_blocks(message)
            staged = into is None
            if into is None:  # staged, scattered once it has arrived
                staging = self._ring.take(size)
                if staging is None:
                    return
                into = staging.view(blocks.cache.dtype).view(blocks.shape(start, end))
            wire = self._wire
            assert isinstance(wire, GlooWire)
            work = wire.pg.recv([into], wire.peer_rank, message.tag)
            self._pending.popleft()
            self._post(work, into, staged, message)

    @staticmethod
    def _into_blocks(message: _Message) -> torch.Tensor | None:
        """The message's blocks themselves when D's ids for it are consecutive and the load
        is still wanted (counted in ``posted``: its end is reported once none is left)."""
        target = message.part.target
        if target is None:
            return None
        run = message.blocks.run(message.kv, message.start, message.end)
        if run is None:
            return None
        with target.lock:
            if target.cancelled:
                return None
            target.posted += 1
        return run

    def _complete_oldest(self) -> None:
        op = self._pop_oldest()
        message: _Message = op.then
        part, target = message.part, message.part.target
        if not op.staged:
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
                        message.blocks.scatter(message.kv, message.start, message.end, op.tensor)
            self._ring.give_back()
        if target is not None:
            part.num_bytes += nbytes(op.tensor)
            if message.last:
                self._on_received(target, part.num_bytes, None)
