"""RateLimitedLog: one WARNING line per cause per interval, with the count it held back."""

from __future__ import annotations

import logging

from pagedkv.transport import rate_limited_log
from pagedkv.transport.rate_limited_log import RateLimitedLog


def test_one_line_per_cause_per_interval_with_the_suppressed_count(caplog, monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(rate_limited_log.time, "monotonic", lambda: now[0])
    log = RateLimitedLog(logging.getLogger("test.rll"), interval_s=10.0)
    with caplog.at_level(logging.WARNING, logger="test.rll"):
        for _ in range(5):
            log.warning("put", "store put failed: %s", "timeout")
        log.warning("lookup", "store lookup failed: %s", "refused")
        now[0] += 10.5
        log.warning("put", "store put failed: %s", "timeout")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "store put failed: timeout",
        "store lookup failed: refused",
        "store put failed: timeout [4 more like this in the last 10s]",
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
