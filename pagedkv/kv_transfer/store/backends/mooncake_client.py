"""MooncakeClient: one Mooncake Store client, set up in the background and let through to
the master only when it is there, so that no call blocks while the master is away.

Mooncake's client blocks where a store call must not: ``setup()`` looks for the master for
about 4.4 s per attempt when there is none (20 attempts by default), and stalls the process's
other Python threads meanwhile (measured: all but the main thread); once a call has found the
master gone (at once: the connection is closed), each later call takes about 4.5 s while the
client tries to reconnect, until its heartbeat (one ping a second) has noticed. Hence:

- setup runs on a thread of its own, started with the backend (which waits up to
  ``connect_timeout_s`` for it) and retried every second until it succeeds or the backend
  closes; each attempt first connects to the master's port (``connect_timeout_s``), and calls
  ``setup()`` only if that succeeds (a ``setup()`` that fails anyway is retried less and less
  often). Until then every call raises ``StoreUnavailable`` at once;
- every call first reads the client's health (``health_check()``, the heartbeat's flag), and
  after a call that found the master unreachable (``suspect_master``), connects to the
  master's port before letting the next one through: either failing, the call raises
  ``StoreUnavailable`` at once, without an RPC;
- the client's own waits are bounded by the connector's timeouts, through the environment
  variables Mooncake reads (set when the first backend is built, unless already set):
  ``MC_RPC_TIMEOUT_MS`` (timeout_s: an RPC to a hung master), ``MC_RPC_CONNECT_TIMEOUT_MS``
  (connect_timeout_s), ``MC_TCP_STATUS_TIMEOUT_SEC`` (timeout_s rounded up: a transfer to a
  hung segment owner) and ``MC_STORE_CLIENT_SETUP_RETRIES`` (1: this class retries).

Buffers registered (``register_buffer``) before the client is set up are registered once it is.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
from typing import Any

import numpy as np

from pagedkv.kv_transfer.store.backends.base import StoreUnavailable
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)
failure_log = RateLimitedLog(logger)

#: Seconds between two attempts to reach the master; a ``setup()`` that fails with the master
#: there is retried after twice as long each time (up to a minute): it stalls other threads.
SETUP_RETRY_S = 1.0
#: ``health_check()``: 0 healthy, 1 not set up (or closed), 2 master unreachable.
HEALTH_MASTER_UNREACHABLE = 2


def set_client_env_defaults(timeout_s: float, connect_timeout_s: float) -> None:
    """Bound the client's waits by the connector's timeouts (a variable already set wins)."""
    defaults = {
        "MC_RPC_TIMEOUT_MS": str(max(1, round(timeout_s * 1000))),
        "MC_RPC_CONNECT_TIMEOUT_MS": str(max(1, round(connect_timeout_s * 1000))),
        "MC_TCP_STATUS_TIMEOUT_SEC": str(max(1, math.ceil(timeout_s))),
        "MC_STORE_CLIENT_SETUP_RETRIES": "1",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)


class MooncakeClient:
    def __init__(
        self, setup_args: tuple[Any, ...], master: tuple[str, int], connect_timeout_s: float
    ) -> None:
        """``setup_args``: ``MooncakeDistributedStore.setup``'s positional arguments, but the
        last (the master's address: ``master``)."""
        self.master = f"{master[0]}:{master[1]}"
        self._master_address = master
        self._setup_args = (*setup_args, self.master)
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        #: The set-up client (None until setup succeeds, and after close).
        self._store: Any = None
        #: Buffers to register, by address (kept alive here while registered).
        self._buffers: dict[int, np.ndarray] = {}
        self._last_error = "not set up yet"
        #: The last call found the master unreachable: look before the next one goes.
        self._master_suspect = False
        self._closed = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._set_up, name="pagedkv-mooncake-setup", daemon=True
        )
        self._thread.start()
        self._ready.wait(connect_timeout_s)

    def store(self) -> Any:
        """The set-up ``MooncakeDistributedStore``, if its master is reachable; otherwise
        ``StoreUnavailable`` at once."""
        store = self._store
        if store is None:
            raise StoreUnavailable(
                f"mooncake: no client for master {self.master} ({self._last_error})"
            )
        if store.health_check() == HEALTH_MASTER_UNREACHABLE:
            raise StoreUnavailable(f"mooncake: master {self.master} unreachable (heartbeat)")
        if self._master_suspect:
            try:
                self._connect_to_master()
            except OSError as e:
                raise StoreUnavailable(f"mooncake: master {self.master} down ({e})") from e
        return store

    def suspect_master(self, suspect: bool) -> None:
        """Record whether the last call through ``store()`` found the master unreachable."""
        self._master_suspect = suspect

    def _connect_to_master(self) -> None:
        socket.create_connection(self._master_address, self._connect_timeout_s).close()

    def register_buffer(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._buffers[buffer.ctypes.data] = buffer
            if self._store is not None:
                self._register(self._store, buffer)

    def unregister_buffer(self, buffer: np.ndarray) -> None:
        with self._lock:
            if self._buffers.pop(buffer.ctypes.data, None) is not None and self._store is not None:
                self._store.unregister_buffer(buffer.ctypes.data)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()

    def _set_up(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        setup_backoff_s = SETUP_RETRY_S
        while not self._closed.is_set():
            store, retry_in_s = MooncakeDistributedStore(), SETUP_RETRY_S
            try:
                self._connect_to_master()
            except OSError as e:
                rc, error = None, f"cannot connect: {e}"
            else:  # the master is there: setup() fails for another cause, which may last
                retry_in_s, setup_backoff_s = setup_backoff_s, min(2 * setup_backoff_s, 60.0)
                try:
                    rc = store.setup(*self._setup_args)
                    error = f"setup returned {rc}"
                except Exception as e:  # the client documents no exceptions: any is a failure
                    rc, error = None, f"setup raised {type(e).__name__}: {e}"
            if rc == 0:
                with self._lock:
                    if not self._closed.is_set():
                        for buffer in self._buffers.values():
                            self._register(store, buffer)
                        self._store = store
                        self._ready.set()
                        return
                store.close()  # closed while setting up
                return
            self._last_error = error
            failure_log.warning(
                "setup",
                "mooncake: no client for master %s (%s); retrying in %.0f s",
                self.master,
                error,
                retry_in_s,
            )
            self._closed.wait(retry_in_s)

    @staticmethod
    def _register(store: Any, buffer: np.ndarray) -> None:
        rc = store.register_buffer(buffer.ctypes.data, buffer.nbytes)
        if rc != 0:  # TCP moves unregistered memory too; RDMA does not, and those calls fail
            failure_log.warning(
                "register",
                "mooncake: register_buffer of %d bytes returned %d; transfers from it may fail",
                buffer.nbytes,
                rc,
            )
