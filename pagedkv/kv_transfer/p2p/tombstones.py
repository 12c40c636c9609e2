"""Tombstones: P's ended transfers, remembered for a while with why they ended.

A late WANT, CANCEL or heartbeat for an ended transfer gets the right answer (a NACK naming
the end, or nothing) instead of starting a new record. Each is kept ``keep_s`` seconds, and
at most ``MAX_TOMBSTONES`` are (the oldest forgotten first): a flood of CANCELs for made-up
transfer ids costs bounded memory.
"""

from __future__ import annotations

import time

MAX_TOMBSTONES = 1 << 16


class Tombstones:
    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        #: transfer id -> (why it ended, when to forget it), oldest first.
        self._ended: dict[str, tuple[str, float]] = {}

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._ended

    def reason(self, transfer_id: str) -> str | None:
        """Why a transfer ended, while it is remembered."""
        tombstone = self._ended.get(transfer_id)
        return None if tombstone is None else tombstone[0]

    def add(self, transfer_id: str, why: str) -> None:
        if transfer_id not in self._ended and len(self._ended) >= MAX_TOMBSTONES:
            del self._ended[next(iter(self._ended))]  # the oldest
        self._ended[transfer_id] = (why, time.monotonic() + self.keep_s)

    def forget_expired(self, now: float) -> None:
        for key in [k for k, (_, expiry) in self._ended.items() if expiry < now]:
            del self._ended[key]
