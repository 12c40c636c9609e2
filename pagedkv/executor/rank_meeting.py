"""Rank 0's side of the ranks' meeting, which must not outlast a rank that died on the way."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_POLL_S = 0.1


def meet_as_rank0(meet: Callable[[], T], check: Callable[[], None]) -> T:
    """``meet()``'s result. It runs on a thread of its own while ``check()`` is polled: a
    ``check`` that raises (a worker rank exited) ends the wait at once, instead of when the
    meeting times out (the thread is left to its timeout)."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(meet())
        except BaseException as e:  # re-raised on the caller's thread
            error.append(e)

    thread = threading.Thread(target=run, name="pagedkv-tp-meeting", daemon=True)
    thread.start()
    while thread.is_alive():
        check()
        thread.join(_POLL_S)
    if error:
        raise error[0]
    return result[0]
