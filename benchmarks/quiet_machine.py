"""How much of the machine other processes use, from ``/proc/stat`` (the method of the
hf_peer anchor's ``bench_hf.py``): wait for a quiet machine before a timed run, and measure
the share others took during it, so that a contended figure is flagged or rerun."""

from __future__ import annotations

import os
import time


def _busy_and_total() -> tuple[float, float]:
    """Seconds of CPU busy and in all, summed over the machine's cores."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    tick = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq + steal
    return busy / tick, (busy + idle + iowait) / tick


def _own_cpu() -> float:
    times = os.times()
    return times.user + times.system


class OthersMeter:
    """While open: the share of the machine's CPU that other processes used."""

    def __enter__(self) -> OthersMeter:
        self._busy, self._total = _busy_and_total()
        self._own = _own_cpu()
        self.share = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        busy, total = _busy_and_total()
        others = (busy - self._busy) - (_own_cpu() - self._own)
        self.share = max(0.0, others / max(total - self._total, 1e-9))


def wait_for_quiet(threshold: float, max_wait_s: float) -> float:
    """Block until other processes use under ``threshold`` of the machine over a second (or
    ``max_wait_s`` passes); the seconds waited."""
    start = time.monotonic()
    while threshold < 1.0 and time.monotonic() - start < max_wait_s:
        with OthersMeter() as meter:
            time.sleep(1.0)
        if meter.share < threshold:
            break
    return time.monotonic() - start
