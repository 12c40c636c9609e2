"""RateLimitedLog: failures logged at WARNING, at most one line per cause per interval.

A transfer path that fails under load fails many times a second; an operator needs to see
each *kind* of failure at the default log level, not a flood. Each line says how many of that
cause were suppressed since the last one, so nothing is silent and nothing floods.
"""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._lock = threading.Lock()
        #: cause -> (when it was last logged, occurrences suppressed since)
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, cause: str, fmt: str, *args: object) -> None:
        """Log ``fmt % args`` at WARNING unless ``cause`` was logged within the interval."""
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(cause, (-self.interval_s - 1.0, 0))
            if now - last < self.interval_s:
                self._last[cause] = (last, suppressed + 1)
                return
            self._last[cause] = (now, 0)
        if suppressed:
            fmt += " [%d more like this in the last %.0fs]"
            args = (*args, suppressed, now - last)
        self.logger.warning(fmt, *args)
