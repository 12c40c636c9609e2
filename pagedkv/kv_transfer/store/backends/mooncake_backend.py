"""Mooncake Store (kvcache-ai/Mooncake) through its Python client, zero-copy.

``mooncake://<master host>:<rpc port>`` (``mooncake_master``, default port 50051), with the
client's ``setup()`` arguments in ``kv_connector_extra_config.mooncake`` (defaults shown)::

    {"store_url": "mooncake://10.0.0.5:50051",
     "mooncake": {"local_hostname": "127.0.0.1",      # this host's address, as peers reach it
                  "metadata_server": "P2PHANDSHAKE",  # no separate metadata server
                  "global_segment_size": 3355443200,  # bytes this instance lends the store
                  "local_buffer_size": 67108864,      # the client's own staging (bytes calls)
                  "protocol": "tcp", "device_name": ""}}

Every client lends ``global_segment_size`` bytes of its memory to the store and the master
places each value in one of the lent segments; the master only keeps the metadata (in memory:
a restarted master has forgotten every key). The scheduler half only looks keys up, so its
client lends nothing.

The connector's blocks move without copies through Python: the writer's encode buffer and the
loader's fetch rows are registered once (``register_buffer``), then ``batch_put_from`` /
``batch_get_into`` move rows of them. ``batch_is_exist`` answers lookups (and gives each key
found a read lease, so it is not evicted before the load that follows). The client answers
with codes, never exceptions: per key, ``OBJECT_NOT_FOUND`` is a miss, a value longer than its
row is fetched as bytes so that the loader sees a corrupt value (and deletes it); any other code
fails the call: ``StoreUnavailable`` for RPC failures (the master down or hung), ``StoreError`` for
the rest (``NO_AVAILABLE_HANDLE``: the segments are full, the put is dropped and counted;
``TRANSFER_FAIL``: the process holding the value died, for the ~10 s until the master drops its
segment). ``put_from`` never replaces a stored value (equal keys hold equal KV, and another
instance may be reading it); ``put_many`` replaces it (``upsert``), as Redis ``SET`` does.
``delete_many`` forces the removal: a value read in the last ``default_kv_lease_ttl`` (10 s)
holds a lease, and a corrupt value that was just read must still go.

Mooncake has no per-key TTL (``ttl_s`` is rejected): the master evicts (approximate LRU at its
high watermark), and evicted blocks are misses. How the client is set up and kept from blocking
is in ``mooncake_client``.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np

from pagedkv.kv_transfer.store.backends.base import (
    Buffer,
    StoreBackend,
    StoreError,
    StoreUnavailable,
)
from pagedkv.kv_transfer.store.backends.mooncake_client import (
    MooncakeClient,
    set_client_env_defaults,
)
from pagedkv.kv_transfer.store.config import StoreConfig

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_PORT = 50051
DEFAULT_SETUP: dict[str, Any] = {
    "local_hostname": "127.0.0.1",
    "metadata_server": "P2PHANDSHAKE",
    "global_segment_size": 3355443200,
    "local_buffer_size": 64 << 20,
    "protocol": "tcp",
    "device_name": "",
}
#: Mooncake refuses a smaller segment (its setup fails with INVALID_PARAMS).
MIN_SEGMENT_SIZE = 16 << 20


class Code(IntEnum):
    """The client's return codes that this backend tells apart (Mooncake's ``ErrorCode``)."""

    OK = 0
    NO_AVAILABLE_HANDLE = -200  # no space left in any segment (and nothing evictable)
    INVALID_PARAMS = -600  # e.g. a value larger than the buffer given for it
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707  # a read outlived its lease (the value may have changed meanwhile)
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    RPC_TIMEOUT = -901


_UNAVAILABLE = {Code.RPC_FAIL, Code.RPC_TIMEOUT}


def _name(code: int) -> str:
    try:
        return Code(code).name
    except ValueError:
        return str(code)


def _failure(call: str, codes: Sequence[int], num_keys: int) -> StoreError:
    """The error for a call over ``num_keys`` keys that answered ``codes`` (the failures)."""
    detail = ", ".join(f"{name} x{n}" for name, n in Counter(map(_name, codes)).items())
    message = f"mooncake: {call} of {num_keys} keys: {detail}"
    if _UNAVAILABLE & set(codes):
        return StoreUnavailable(message)
    return StoreError(message)


def _check_length(call: str, answers: Sequence[Any], num_keys: int) -> None:
    if len(answers) != num_keys:
        raise StoreError(f"mooncake: {call} answered {len(answers)} times for {num_keys} keys")


def _check(call: str, codes: Sequence[int], num_keys: int, ok: set[int]) -> None:
    _check_length(call, codes, num_keys)
    failed = [c for c in codes if c not in ok]
    if failed:
        raise _failure(call, failed, num_keys)


def _client_call(method: F) -> F:
    """A call through the client: any exception it raises is a StoreError (a miss), and the
    client learns whether the master answered."""

    @functools.wraps(method)
    def wrapped(self: MooncakeBackend, *args: Any) -> Any:
        try:
            result = method(self, *args)
        except StoreUnavailable:
            self.client.suspect_master(True)
            raise
        except StoreError:
            self.client.suspect_master(False)
            raise
        except Exception as e:
            raise StoreError(f"mooncake: {type(e).__name__}: {e}") from e
        self.client.suspect_master(False)
        return result

    return wrapped  # type: ignore[return-value]


def setup_options(options: dict[str, Any]) -> dict[str, Any]:
    """``kv_connector_extra_config.mooncake`` over the defaults, each field checked."""
    unknown = sorted(set(options) - set(DEFAULT_SETUP))
    if unknown:
        raise ValueError(
            f"unknown kv_connector_extra_config.mooncake option(s) {unknown}; "
            f"known: {sorted(DEFAULT_SETUP)}"
        )
    merged = {**DEFAULT_SETUP, **options}
    for name, value in merged.items():
        if isinstance(DEFAULT_SETUP[name], int):
            valid = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            kind = "a byte count >= 0"
        else:
            valid = isinstance(value, str) and (name == "device_name" or value != "")
            kind = "a string" if name == "device_name" else "a non-empty string"
        if not valid:
            raise ValueError(f"kv_connector_extra_config.mooncake.{name} must be {kind}")
    if 0 < merged["global_segment_size"] < MIN_SEGMENT_SIZE:
        raise ValueError(
            "kv_connector_extra_config.mooncake.global_segment_size must be 0 (lend nothing) "
            "or at least 16 MiB (Mooncake's smallest segment)"
        )
    return merged


def _row_addresses(rows: np.ndarray, num_rows: int) -> tuple[list[int], list[int]]:
    """The address and size of each of the first ``num_rows`` rows of a C-contiguous array."""
    start, stride = rows.ctypes.data, rows.strides[0]
    return [start + i * stride for i in range(num_rows)], [rows.shape[1]] * num_rows


class MooncakeBackend(StoreBackend):
    def __init__(self, config: StoreConfig, lookups_only: bool = False) -> None:
        """``lookups_only``: a client that only looks keys up lends no memory."""
        super().__init__(config.ttl_s)
        if config.ttl_s is not None:
            raise ValueError("the mooncake backend has no per-key TTL: leave ttl_s unset")
        setup = setup_options(config.mooncake)
        if lookups_only:
            setup.update(global_segment_size=0, local_buffer_size=0)
        url = urlsplit(config.store_url)
        try:
            port = url.port or DEFAULT_PORT
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config.store_url: {e}") from None
        if not url.hostname:
            raise ValueError("kv_connector_extra_config.store_url: mooncake:// needs a host")
        try:
            import mooncake.store  # noqa: F401
        except ImportError as e:
            raise ValueError(
                "store_url mooncake:// needs Mooncake's Python client: pip install "
                "'pagedkv[mooncake]' (the CPU build, mooncake-transfer-engine-non-cuda), or "
                "mooncake-transfer-engine with CUDA"
            ) from e
        set_client_env_defaults(config.timeout_s, config.connect_timeout_s)
        self.client = MooncakeClient(
            (
                setup["local_hostname"],
                setup["metadata_server"],
                setup["global_segment_size"],
                setup["local_buffer_size"],
                setup["protocol"],
                setup["device_name"],
            ),
            master=(url.hostname, port),
            connect_timeout_s=config.connect_timeout_s,
        )

    def register_buffer(self, buffer: np.ndarray) -> None:
        self.client.register_buffer(buffer)

    def unregister_buffer(self, buffer: np.ndarray) -> None:
        self.client.unregister_buffer(buffer)

    @_client_call
    def _exists_many(self, keys: Sequence[str]) -> list[bool]:
        codes = self.client.store().batch_is_exist(list(keys))
        _check("batch_is_exist", codes, len(keys), ok={0, 1})
        return [code == 1 for code in codes]

    @_client_call
    def _put_from(self, keys: Sequence[str], rows: np.ndarray) -> None:
        store = self.client.store()
        codes = store.batch_put_from(list(keys), *_row_addresses(rows, len(keys)))
        _check("batch_put_from", codes, len(keys), ok={Code.OK, Code.OBJECT_ALREADY_EXISTS})

    @_client_call
    def _get_into(self, keys: Sequence[str], rows: np.ndarray) -> list[Buffer | None]:
        store = self.client.store()
        codes = store.batch_get_into(list(keys), *_row_addresses(rows, len(keys)))
        _check_length("batch_get_into", codes, len(keys))
        values: list[Buffer | None] = []
        failed = []
        for key, row, code in zip(keys, rows, codes):
            if code >= 0:  # the value's length
                values.append(memoryview(row)[:code])
            elif code == Code.OBJECT_NOT_FOUND:
                values.append(None)
            elif code == Code.INVALID_PARAMS:  # longer than a row: not one of our values
                values.append(store.get(key))
            else:
                failed.append(code)
        if failed:
            raise _failure("batch_get_into", failed, len(keys))
        return values

    @_client_call
    def _put_many(self, items: Sequence[tuple[str, Buffer]]) -> None:
        rc = self.client.store().upsert_batch([k for k, _ in items], [v for _, v in items])
        if rc != Code.OK:  # one code for the batch
            raise _failure("upsert_batch", [rc], len(items))

    @_client_call
    def _get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        """Through the client's own buffer (``local_buffer_size`` bounds one call); it answers
        empty bytes, with no code, for a key missing or failed."""
        values = self.client.store().get_batch(list(keys))
        _check_length("get_batch", values, len(keys))
        return [value if len(value) else None for value in values]

    @_client_call
    def _delete_many(self, keys: Sequence[str]) -> None:
        codes = self.client.store().batch_remove(list(keys), force=True)
        _check("batch_remove", codes, len(keys), ok={Code.OK, Code.OBJECT_NOT_FOUND})

    def close(self) -> None:
        self.client.close()
