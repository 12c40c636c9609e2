"""PairStore: the rendezvous store of one pair group, carried by our authenticated control plane.

gloo's rendezvous needs a key/value store: each rank ``set``s its address and ``get``s the
other's. ``torch.distributed.TCPStore`` would open a second listening port that binds every
interface whatever address it is given (the CVE-2025-47277 class of flaw), and speaks an
unauthenticated protocol. Here both instances keep a mirror of the pair's few keys instead:
``set`` stores locally and sends a ``StoreSet`` message over the control plane (HMAC-checked
like every message); ``get``/``wait`` wait for the key to arrive locally, with a timeout.
Only ``set``, ``get``, ``wait`` and ``check`` are used by gloo's rendezvous.

Keep a Python reference to a PairStore for as long as its process group is being created:
pybind11 resolves the overrides through the Python object.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

_MAX_KEYS = 64
_MAX_VALUE_BYTES = 16 << 10


class PairStore(dist.Store):
    def __init__(self, publish: Callable[[str, bytes], None], timeout_s: float) -> None:
        super().__init__()
        self._publish = publish
        self._timeout_s = timeout_s
        self._values: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._aborted: str | None = None

    # ------------------------------------------------------------------ the peer's side
    def deliver(self, key: str, value: bytes) -> bool:
        """A key set by the peer arrived; False (ignored) past the store's small limits."""
        with self._cond:
            if len(self._values) >= _MAX_KEYS or len(value) > _MAX_VALUE_BYTES:
                return False
            self._values[key] = value
            self._cond.notify_all()
            return True

    def abort(self, reason: str) -> None:
        """Make every pending and future ``get``/``wait`` raise (the group is abandoned)."""
        with self._cond:
            self._aborted = reason
            self._cond.notify_all()

    # ------------------------------------------------------------------ torch.distributed.Store
    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        with self._cond:
            self._values[key] = data
            self._cond.notify_all()
        self._publish(key, data)

    def get(self, key: str) -> bytes:
        self._wait_for([key], self._timeout_s)
        with self._cond:
            return self._values[key]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        self._wait_for(keys, seconds)

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._values for k in keys)

    def _wait_for(self, keys: list[str], timeout_s: float) -> None:
        with self._cond:
            arrived = self._cond.wait_for(
                lambda: self._aborted is not None or all(k in self._values for k in keys),
                timeout=timeout_s,
            )
            if self._aborted is not None:
                raise RuntimeError(f"pair group rendezvous abandoned: {self._aborted}")
            if not arrived:
                raise TimeoutError(
                    f"pair group rendezvous: keys {keys} did not arrive within {timeout_s:.1f}s"
                )
