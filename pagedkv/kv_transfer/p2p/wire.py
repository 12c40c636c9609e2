"""Wires: what a pair group's lanes move their messages over.

``GlooWire``: the two-rank gloo process group (any two hosts; lanes.py, receive_lane.py).
``ShmWire``: the pair's shared-memory segment, one ring each way (same host and boot only;
shm_lanes.py), plus a pidfd on the peer process, so a lane waiting on the peer learns at
once that it died instead of at a timeout.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from torch.distributed import ProcessGroupGloo

from pagedkv.kv_transfer.p2p.shm_segment import ShmSegment

T = TypeVar("T")

#: A lane waiting on its ring sleeps this long at first, doubling up to ``_MAX_SLEEP_S``.
_MIN_SLEEP_S = 20e-6
_MAX_SLEEP_S = 1e-3


class WireError(RuntimeError):
    """The wire can't be used any more (the peer died, or did not move within the timeout)."""


@dataclass(frozen=True)
class GlooWire:
    kind = "gloo"
    pg: ProcessGroupGloo
    peer_rank: int


class ShmWire:
    kind = "shm"

    def __init__(self, segment: ShmSegment, rank: int, peer_pid: int) -> None:
        self.segment = segment
        self.send_ring = segment.ring(rank)
        self.recv_ring = segment.ring(1 - rank)
        self.peer_pid = peer_pid
        self._pidfd: int | None = os.pidfd_open(peer_pid)

    def wait(self, ready: Callable[[], T | None], timeout_s: float, check: Callable[[], None]) -> T:
        """``ready()``'s first value that is not None, polled with a growing sleep. Raises
        WireError when the peer process exits, either side tears the pair down or
        ``timeout_s`` passes; ``check()`` may raise to give up (the lane was stopped)."""
        deadline = time.monotonic() + timeout_s
        sleep_s = _MIN_SLEEP_S
        while True:
            value = ready()
            if value is not None:
                return value
            check()
            if self.segment.pair_closed:
                raise WireError("the pair was torn down")
            if time.monotonic() > deadline:
                raise WireError(f"the peer did not move within {timeout_s:g}s")
            if select.select([self._pidfd], [], [], sleep_s)[0]:
                raise WireError(f"the peer process {self.peer_pid} exited")
            sleep_s = min(2 * sleep_s, _MAX_SLEEP_S)

    def __del__(self) -> None:
        """The last holder (a lane's thread or its pair group) let go: so does the pidfd, and
        the segment is unmapped with its last view."""
        pidfd, self._pidfd = self._pidfd, None
        if pidfd is not None:
            os.close(pidfd)


Wire = GlooWire | ShmWire
