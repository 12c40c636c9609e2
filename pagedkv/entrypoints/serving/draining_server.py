"""DrainingServer: uvicorn, where SIGTERM and SIGINT drain the server and the process exits 0.

uvicorn alone re-raises the signal once its own shutdown is done, so the process dies with
status 143 before the caller's cleanup runs (a ``pagedkv serve`` never deregistered from its
proxy and never stopped its KV connector). Here a signal starts a drain instead::

    signal ──> begin_drain() (deregister: routing stops at once)
          ──> stop accepting; idle keep-alive connections closed
          ──> in-flight requests finish ...
    + shutdown_timeout_s ──> abort_in_flight(): what is still running ends with a clear error
    + ABORT_GRACE_S      ──> uvicorn cancels whatever is left (a backstop)
          ──> ``serve`` returns; the caller stops the engine and exits 0

A second SIGINT (Ctrl-C twice) forces the exit at once, as in uvicorn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

#: How long ``pagedkv serve`` and ``pagedkv proxy`` keep an idle HTTP/1.1 connection open.
#: Longer than any client's own idle expiry (httpx's, which the proxy and ``bench serve``
#: use, is 5 s; uvicorn's default was 5 s too): with equal timeouts a client reused a
#: connection just as the server closed it, and a request under load failed with a
#: ReadError before a byte of it was answered (about one in 600 at 64 clients).
KEEP_ALIVE_S = 75

#: After the in-flight requests were aborted, how long their answers get to go out.
ABORT_GRACE_S = 5.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        shutdown_timeout_s: float,
        begin_drain: Callable[[], None] = lambda: None,
        abort_in_flight: Callable[[str], None] = lambda reason: None,
    ) -> None:
        config.timeout_graceful_shutdown = shutdown_timeout_s + ABORT_GRACE_S
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s
        self._begin_drain = begin_drain
        self._abort_in_flight = abort_in_flight
        #: The signal that started the drain (None: not by a signal).
        self.signal: int | None = None

    @classmethod
    def for_app(
        cls,
        app: Any,
        args: argparse.Namespace,
        begin_drain: Callable[[], None] = lambda: None,
        abort_in_flight: Callable[[str], None] = lambda reason: None,
    ) -> DrainingServer:
        """``app`` served as ``pagedkv serve`` and ``pagedkv proxy`` serve theirs: on
        ``args.host``:``args.port`` at ``args.log_level``, draining for ``args.shutdown_timeout``
        seconds, idle connections kept ``KEEP_ALIVE_S``."""
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        return cls(config, args.shutdown_timeout, begin_drain, abort_in_flight)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's, without re-raising the signal afterwards."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        if self.signal is None:
            self.signal = sig
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        if self.signal is not None:
            logger.info(
                "%s: draining (in-flight requests get up to %g s; --shutdown-timeout)",
                signal.Signals(self.signal).name,
                self.shutdown_timeout_s,
            )
        await asyncio.get_running_loop().run_in_executor(None, self._begin_drain)
        watchdog = asyncio.create_task(self._abort_when_overdue())
        try:
            await super().shutdown(sockets)
        finally:
            watchdog.cancel()

    async def _abort_when_overdue(self) -> None:
        await asyncio.sleep(self.shutdown_timeout_s)
        if self.server_state.connections:
            reason = (
                f"the server is shutting down: the request was still running "
                f"{self.shutdown_timeout_s:g} s after the shutdown began (--shutdown-timeout)"
            )
            logger.warning("aborting what is still in flight: %s", reason)
            self._abort_in_flight(reason)
