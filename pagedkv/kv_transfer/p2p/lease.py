"""LeaseTable: how long P keeps a transfer's KV without word from D.

A lease starts at ``lease_s`` when P learns of the transfer and is pushed forward by D's
heartbeats (``renew``). The reaper asks for ``expired(now)`` and gets every overdue key by
scanning the whole table: renewals reorder deadlines, so insertion order says nothing about
expiry (the bug behind vllm#58222, where expired blocks were never reclaimed). Deadlines are
this process's monotonic clock; nothing crosses processes but durations.
"""

from __future__ import annotations

import time


class LeaseTable:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._deadlines: dict[str, float] = {}

    def grant(self, key: str, now: float | None = None) -> None:
        """Start (or restart) ``key``'s lease."""
        self._deadlines[key] = (time.monotonic() if now is None else now) + self.lease_s

    def renew(self, key: str, now: float | None = None) -> bool:
        """Push ``key``'s deadline to ``now + lease_s`` (never earlier); False if unknown."""
        if key not in self._deadlines:
            return False
        deadline = (time.monotonic() if now is None else now) + self.lease_s
        self._deadlines[key] = max(self._deadlines[key], deadline)
        return True

    def release(self, key: str) -> None:
        self._deadlines.pop(key, None)

    def expired(self, now: float | None = None) -> list[str]:
        """Every key past its deadline (they stay leased until released)."""
        now = time.monotonic() if now is None else now
        return [key for key, deadline in self._deadlines.items() if deadline < now]
