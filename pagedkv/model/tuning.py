"""Choosing between two equivalent implementations by timing them on this machine, at startup."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

#: Rows of the batch that batched products are timed with (a mid-size decode batch).
TUNE_ROWS = 32


def first_is_faster(
    first: Callable[[], object], second: Callable[[], object], repeats: int
) -> bool:
    """Both, alternately, ``repeats`` times after a warm-up round (not counted): whether
    ``first`` has the smaller median time. Alternating makes both meet the same machine on a
    host whose speed drifts."""
    times: tuple[list[float], list[float]] = ([], [])
    with torch.no_grad():
        for attempt in range(repeats + 1):
            for run, recorded in zip((first, second), times):
                start = time.perf_counter()
                run()
                if attempt:
                    recorded.append(time.perf_counter() - start)
    return statistics.median(times[0]) < statistics.median(times[1])
