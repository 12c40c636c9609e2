"""Lanes: the data path of one pair group, one thread per direction (SendLane here,
ReceiveLane in receive_lane.py).

P's ``SendLane`` sends the transfers queued for one D one after another, in the order P
queued them: it takes what is queued (up to ``MAX_PARTS`` transfers) as one wire batch,
announces it (XFER_BEGIN over the control plane, whose connection keeps its order), then
sends the batch layer-major through gloo with at most ``in_flight_bytes`` outstanding (a
message is a slice of the cache, or packed into a reused staging ring while the previous ones
are on the wire), the next batch following on without a gap. D's ``ReceiveLane`` receives the
batches in the order their XFER_BEGINs arrived, with at most ``in_flight_bytes`` of receives
posted, straight into runs of its blocks or into its staging ring and scattered, unless the
load was cancelled meanwhile (then the rest drains into staging: the lane stays in step).

One ordered lane each way, because a gloo send moves only once the receiver has posted a
matching receive, and a wait that times out closes the whole pair: were sends issued from
several threads on P and receives from a shared pool on D, P could wait for a receive D has no
thread left to post, until the wait timed out and every transfer on the pair failed. With
one lane each way, both in batch order, the receive P waits for is always one D is about to
post, so the op timeout (``transfer_timeout_s``) is only a backstop for a dead or hung peer.
A lane whose gloo op fails is *broken*: its pair group must be torn down.

A lane holds the group's process group until its thread ends; ``stop`` ends the thread once
its posted operations have completed or failed (a ProcessGroupGloo is only released, with
its sockets and threads, when nothing references it any more).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from pagedkv.kv_transfer.p2p.protocol import MAX_PARTS, XferBegin, XferPart
from pagedkv.kv_transfer.p2p.transfer import LayerBlocks, nbytes
from pagedkv.kv_transfer.p2p.wire import GlooWire, Wire

logger = logging.getLogger(__name__)

_tags = itertools.count(1)


def _next_tag() -> int:
    return next(_tags) % (1 << 30) + 1


class LaneError(RuntimeError):
    """The lane can't go on in step with its peer: its pair group must be torn down."""


class Source(Protocol):
    def layer(self, layer_idx: int) -> LayerBlocks:
        """This transfer's share of layer ``layer_idx`` (may wait until it is computed)."""
        ...


@dataclass(eq=False)
class Job:
    """One transfer for a SendLane. ``ended`` is set once the lane is done with it (sent, or
    failed: ``error``); only then may its source's memory change."""

    transfer_id: str
    segments: list[list[int]]
    source: Source
    num_bytes: int
    #: KV heads per block in its messages (XferPart.num_heads; 0: all the peer's rank holds).
    num_heads: int = 0
    error: Exception | None = None
    ended: threading.Event = field(default_factory=threading.Event)


class Posted(NamedTuple):
    """A gloo send or receive in flight: ``tensor`` is in use (in the staging ring if
    ``staged``) until ``work`` completes, which ends ``then`` (SendLane: the jobs whose last
    send it is; ReceiveLane: the message it receives)."""

    work: Any
    tensor: torch.Tensor
    staged: bool
    then: Any


class StagingRing:
    """One reused staging buffer, handed out first in, first out: a message takes the next
    ``size`` bytes (wrapping to the start when the end is too short) and gives them back once
    its send or receive (and scatter) is done. At most ``capacity`` bytes (or one larger
    message) are ever allocated; reusing them spares the page faults of fresh buffers."""

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


class Lane:
    """A lane over a ``GlooWire``; shm_lanes.py has the same lanes over a ``ShmWire``."""

    def __init__(
        self,
        wire: Wire,
        on_broken: Callable[[str], None],
        in_flight_bytes: int,
        timeout_s: float,
        name: str,
    ) -> None:
        self._wire: Wire | None = wire
        self._on_broken = on_broken
        self._in_flight_bytes = in_flight_bytes
        self._ring = StagingRing(in_flight_bytes)
        #: Posted operations, oldest first, and their bytes (at most ``in_flight_bytes``,
        #: or one larger message).
        self._window: deque[Posted] = deque()
        self._window_bytes = 0
        self._timeout_s = timeout_s
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self.name = name
        self._cond = threading.Condition()
        self._stopped: str | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, reason: str) -> None:
        with self._cond:
            if self._stopped is None:
                self._stopped = reason
            self._cond.notify_all()

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _check_stopped(self) -> None:
        if self._stopped is not None:
            raise LaneError(f"pair group torn down: {self._stopped}")

    def _wait(self, work) -> None:
        work.wait(self._timeout)

    def _broke(self, reason: str) -> None:
        """The lane can't go on (unless it was stopped): its pair group must go."""
        if self._stopped is None:
            logger.warning("%s broken: %s", self.name, reason)
            self._on_broken(reason)

    def _settle(self) -> None:
        """Wait for posted operations to end, failed or not: gloo reads or writes their memory
        until then."""
        for posted in self._window:
            with contextlib.suppress(Exception):
                self._wait(posted.work)

    def _post(self, work, tensor: torch.Tensor, staged: bool, then) -> Posted:
        posted = Posted(work, tensor, staged, then)
        self._window.append(posted)
        self._window_bytes += nbytes(tensor)
        return posted

    def _pop_oldest(self) -> Posted:
        """The oldest posted operation, once it has completed (its staging not given back)."""
        self._wait(self._window[0].work)
        posted = self._window.popleft()
        self._window_bytes -= nbytes(posted.tensor)
        return posted

    #: An idle lane keeps its staging buffer this long, then lets it go.
    IDLE_RELEASE_S = 2.0

    def _idle_wait(self) -> None:
        """Wait for work (the condition held); an idle lane lets its staging buffer go."""
        if not self._cond.wait(self.IDLE_RELEASE_S):
            self._ring.release()

    def _main(self) -> None:
        try:
            self._run()
        except Exception as e:  # stopped, or broken: what is still here ends, failed
            self._broke(str(e))
            self._settle()  # memory is reused only after
            # A fresh error for the jobs: one carrying this traceback would keep the lane's
            # frames (and the wire they name) alive for as long as a job is remembered.
            self._fail(LaneError(str(e)))
        finally:
            self._wire = None  # the last reference: sockets, threads or shared memory go
            self._window.clear()
            self._ring = StagingRing(0)

    def _run(self) -> None:
        """The lane's loop: it only ends by raising (LaneError once stopped)."""
        raise NotImplementedError

    def _fail(self, error: LaneError) -> None:
        """End, failed, everything the lane still had queued or in flight."""
        raise NotImplementedError


class SendLane(Lane):
    """P's side; ``on_end(job)`` reports each job once (``job.error`` None: all sent),
    ``on_broken(reason)`` a lane that can't go on."""

    def __init__(
        self,
        wire: Wire,
        group: str,
        num_layers: int,
        announce: Callable[[XferBegin], bool],
        on_end: Callable[[Job], None],
        on_broken: Callable[[str], None],
        in_flight_bytes: int,
        timeout_s: float,
        name: str,
    ) -> None:
        super().__init__(wire, on_broken, in_flight_bytes, timeout_s, name)
        self.group = group
        self._num_layers = num_layers
        self._announce = announce
        self._on_end = on_end
        self._queue: deque[Job] = deque()
        #: The batch being sent (taken from the queue, not yet in the window).
        self._batch: list[Job] = []

    def submit(self, jobs: list[Job]) -> bool:
        """Queue jobs to go out in this order; False (nothing queued) once stopped."""
        with self._cond:
            if self._stopped is not None:
                return False
            self._queue.extend(jobs)
            self._cond.notify_all()
            return True

    def cancel(self, transfer_id: str) -> Job | None:
        """Take a job out of the queue if its batch has not started (it then never goes out)."""
        with self._cond:
            for job in self._queue:
                if job.transfer_id == transfer_id:
                    self._queue.remove(job)
                    return job
        return None

    def stop(self, reason: str) -> list[Job]:
        """No more batches; returns the queued jobs that never started (the caller ends them).
        Jobs in flight end (failed) once their posted sends complete or fail."""
        with self._cond:
            jobs = list(self._queue)
            self._queue.clear()
        super().stop(reason)
        return jobs

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._window and self._stopped is None:
                    self._idle_wait()
                self._check_stopped()
                count = min(MAX_PARTS, len(self._queue))
                self._batch = [self._queue.popleft() for _ in range(count)]
            if self._batch:
                self._send_batch(self._batch)
                self._batch = []
            else:
                self._complete_oldest()

    def _fail(self, error: LaneError) -> None:
        with self._cond:
            leftover = list(self._queue)
            self._queue.clear()
        in_flight = [job for sent in self._window for job in sent.then]
        for job in self._batch + in_flight + leftover:
            job.error = error
            self._end(job)

    def _send_batch(self, batch: list[Job]) -> None:
        tag = _next_tag()
        parts = [XferPart(job.transfer_id, job.segments, job.num_heads) for job in batch]
        if not self._announce(XferBegin(self.group, tag, parts)):
            for job in batch:  # D never heard of this batch: nothing went out of step
                job.error = LaneError("could not announce the transfer to D")
                self._end(job)
            return
        last: Posted | None = None
        for layer in range(self._num_layers):
            for job in batch:
                blocks = job.source.layer(layer)
                for kv, start, end in blocks.messages():
                    self._check_stopped()
                    last = self._send_message(blocks, kv, start, end, tag) or last
        if last is None:  # nothing in flight (nothing to send, or all sent already)
            for job in batch:
                self._end(job)
        else:
            last.then.extend(batch)

    def _send_message(
        self, blocks: LayerBlocks, kv: int, start: int, end: int, tag: int
    ) -> Posted | None:
        """Put message ``(kv, start, end)`` on the wire; the send in flight, if any."""
        size = blocks.num_bytes(start, end)
        while self._window and self._window_bytes + size > self._in_flight_bytes:
            self._complete_oldest()
        message = blocks.run(kv, start, end)  # sent from the blocks themselves
        packed = message is None
        if packed:  # packed into the ring while earlier messages are on the wire
            staging = self._ring.take(size)
            while staging is None:
                self._complete_oldest()
                staging = self._ring.take(size)
            message = staging.view(blocks.cache.dtype).view(blocks.shape(start, end))
            blocks.gather(kv, start, end, message)
        wire = self._wire
        assert isinstance(wire, GlooWire)
        work = wire.pg.send([message], wire.peer_rank, tag)
        return self._post(work, message, packed, [])

    def _complete_oldest(self) -> None:
        sent = self._pop_oldest()
        if sent.staged:
            self._ring.give_back()
        for job in sent.then:
            self._end(job)

    def _end(self, job: Job) -> None:
        job.ended.set()
        self._on_end(job)
