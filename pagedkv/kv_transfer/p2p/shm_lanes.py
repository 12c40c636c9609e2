"""The lanes over a same-host pair's shared memory (``ShmWire``): the same batches, order,
cancels and failures as over gloo (lanes.py, receive_lane.py), with no socket and no staging
copy.

P's lane gathers each message straight from its blocks (or its PUT_ASYNC/GET copy) into the
next room of the ring P writes, and publishes it. As over gloo, a send is complete (and a job
ends) once D has taken it, so a batch D never heard of (its XFER_BEGIN lost) fails P's lane
after ``transfer_timeout_s`` instead of leaving the rings out of step. D's lane takes the
messages in order and scatters each straight from the ring into its blocks (under the load's
lock, unless the load was cancelled: then it is only released), then gives the room back.
That is one copy on each side, done by the two processes at once. The ring's room is the flow
control: P waits while D has not released enough. A wait on the peer polls the ring with a
growing sleep, and ends at once if the peer process exits (its pidfd), either side tears the
pair down or the lane is stopped, else after ``transfer_timeout_s``. Nothing stays posted
into D's blocks across calls, so a cancel takes effect at once.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

from pagedkv.kv_transfer.p2p.lanes import LaneError, Posted, SendLane
from pagedkv.kv_transfer.p2p.receive_lane import ReceiveLane
from pagedkv.kv_transfer.p2p.transfer import LayerBlocks
from pagedkv.kv_transfer.p2p.wire import ShmWire, Wire, WireError


def lane_classes(wire: Wire) -> tuple[type[SendLane], type[ReceiveLane]]:
    """The (send, receive) lane classes for ``wire``."""
    if isinstance(wire, ShmWire):
        return ShmSendLane, ShmReceiveLane
    return SendLane, ReceiveLane


def _shm(wire) -> ShmWire:
    if not isinstance(wire, ShmWire):
        raise LaneError("the lane's wire is gone")
    return wire


class _Taken:
    """A published message, complete once D has released it (``wait``, as gloo's work)."""

    def __init__(self, wire: ShmWire, seq: int, check: Callable[[], None]) -> None:
        self._wire, self.seq, self._check = wire, seq, check

    def taken(self) -> bool | None:
        """True once D has released the message; None (keep waiting) before."""
        return self._wire.send_ring.consumed(self.seq) or None

    def wait(self, timeout: datetime.timedelta) -> None:
        try:
            self._wire.wait(self.taken, timeout.total_seconds(), self._check)
        except WireError as e:
            raise LaneError(str(e)) from e


class ShmSendLane(SendLane):
    def _send_message(
        self, blocks: LayerBlocks, kv: int, start: int, end: int, tag: int
    ) -> Posted | None:
        wire = _shm(self._wire)
        ring = wire.send_ring
        size = blocks.num_bytes(start, end)
        try:
            room = wire.wait(lambda: ring.reserve(size), self._timeout_s, self._check_stopped)
        except (WireError, ValueError) as e:
            raise LaneError(str(e)) from e
        out = room.view(blocks.cache.dtype).view(blocks.shape(start, end))
        run = blocks.run(kv, start, end)
        if run is None:
            blocks.gather(kv, start, end, out)
        else:
            out.copy_(run)
        seq = ring.publish(tag)
        while self._window and ring.consumed(self._window[0].work.seq):
            self._complete_oldest()  # already taken: no wait
        return self._post(_Taken(wire, seq, self._check_stopped), out, False, [])


class ShmReceiveLane(ReceiveLane):
    def _post_pending(self) -> None:
        """Take every planned message in order, waiting for each to be published."""
        wire = _shm(self._wire)
        ring = wire.recv_ring
        while self._pending:
            message = self._pending[0]
            blocks, kv, start, end = message.blocks, message.kv, message.start, message.end
            size = blocks.num_bytes(start, end)
            try:
                tag, data = wire.wait(ring.peek, self._timeout_s, self._check_stopped)
            except (WireError, ValueError) as e:
                raise LaneError(str(e)) from e
            if tag != message.tag or data.numel() != size:
                raise LaneError(
                    f"out of step: got {data.numel()} bytes of batch {tag}, "
                    f"expected {size} of batch {message.tag}"
                )
            part, target = message.part, message.part.target
            if target is not None:
                with target.lock:
                    if not target.cancelled:
                        view = data.view(blocks.cache.dtype).view(blocks.shape(start, end))
                        blocks.scatter(kv, start, end, view)
            ring.release()
            self._pending.popleft()
            if target is not None:
                part.num_bytes += size
                if message.last:
                    self._on_received(target, part.num_bytes, None)
