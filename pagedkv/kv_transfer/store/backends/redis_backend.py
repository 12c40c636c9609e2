"""Redis (or Redis Cluster) through redis-py, every call one round trip (MSET / MGET, or a
pipeline where a batch needs several commands: TTLs, existence checks, cluster slots).

``redis://host:port/db`` (``rediss://`` for TLS) uses one connection pool shared by the
connector's threads; ``redis+cluster://host:port`` (``rediss+cluster://``) uses
``RedisCluster``, whose non-transactional pipelines split a batch by hash slot. The client is
built at startup, so a malformed URL is an error then, but connects on first use (a cluster
client, which reads the slot map when built, is built then): a store that is down at startup
is a miss, not a crash.

Values travel without extra copies: memoryviews are handed to the socket as they are. redis-py
packs commands with hiredis when it is installed, which copies each large value into one
buffer (~8x slower for MSET of 64 x 256 KiB), so the pure-Python packer is used for sending
while hiredis still parses replies. Retries are off: a failed call is a miss, and the circuit
breaker keeps later calls from each waiting for a timeout.

Bounded memory: ``ttl_s`` sets an expiry on every value; or run the server with
``maxmemory <bytes>`` and ``maxmemory-policy allkeys-lru``, and evicted blocks become misses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import HIREDIS_AVAILABLE, PythonRespSerializer, parse_url
from redis.retry import Retry

from pagedkv.kv_transfer.store.backends.base import (
    Buffer,
    StoreBackend,
    StoreError,
    StoreUnavailable,
)
from pagedkv.kv_transfer.store.config import StoreConfig

T = TypeVar("T")
#: Replies are read in chunks of this size (redis-py's 64 KiB default is slow for MiB values).
SOCKET_READ_SIZE = 1 << 20
_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.RedisClusterException,  # no reachable node with cluster mode
    OSError,
)


def _call(fn: Callable[[], T]) -> T:
    """Run one redis-py call, mapping its failures onto the backend's two errors (anything
    redis-py raises besides its own errors is a StoreError too: a miss, never a crash)."""
    try:
        return fn()
    except _UNAVAILABLE as e:
        raise StoreUnavailable(f"redis: {e}") from e
    except redis.exceptions.RedisError as e:
        raise StoreError(f"redis: {e}") from e
    except Exception as e:
        raise StoreError(f"redis: unexpected {type(e).__name__}: {e}") from e


class RedisBackend(StoreBackend):
    def __init__(self, config: StoreConfig, lookups_only: bool = False) -> None:
        """``lookups_only`` changes nothing here (see ``create_backend``)."""
        super().__init__(config.ttl_s)
        self.is_cluster = config.scheme.endswith("+cluster")
        self._url = config.store_url.replace("+cluster", "", 1)
        self._options = dict(
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.connect_timeout_s,
            socket_read_size=SOCKET_READ_SIZE,
            retry=Retry(NoBackoff(), 0),
        )
        self._client: redis.Redis | RedisCluster | None = None
        self._client_lock = threading.Lock()
        try:
            if self.is_cluster:
                parse_url(self._url)  # what RedisCluster.from_url will parse
            else:
                self._client = self._new_client()
        except ValueError as e:  # the URL; the message leaves out a password it may hold
            raise ValueError(f"kv_connector_extra_config.store_url: {e}") from None

    def _new_client(self) -> redis.Redis | RedisCluster:
        if self.is_cluster:
            # Connects (reads the slot map) right away: inside _call, a failure is a miss.
            return RedisCluster.from_url(self._url, **self._options)
        options = dict(self._options)
        if HIREDIS_AVAILABLE:
            encoder = redis.connection.Encoder("utf-8", "strict", False)
            options["command_packer"] = PythonRespSerializer(6000, encoder.encode)
        return redis.Redis(connection_pool=redis.ConnectionPool.from_url(self._url, **options))

    def _get_client(self) -> redis.Redis | RedisCluster:
        with self._client_lock:
            if self._client is None:  # a cluster client, or one closed
                self._client = self._new_client()
            return self._client

    def _pipelined(self, add: Callable[[redis.client.Pipeline], None]) -> list:
        def run() -> list:
            pipe = self._get_client().pipeline(transaction=False)
            add(pipe)
            return pipe.execute()

        return _call(run)

    def _exists_many(self, keys: Sequence[str]) -> list[bool]:
        def add(pipe) -> None:
            for key in keys:
                pipe.exists(key)

        return [bool(n) for n in self._pipelined(add)]

    def _exists_all(self, key_sets: Sequence[Sequence[str]]) -> list[bool]:
        """One ``EXISTS`` per set (it counts the keys stored); a cluster's sets may span hash
        slots, so there each key is asked on its own."""
        if self.is_cluster:
            return super()._exists_all(key_sets)

        def add(pipe) -> None:
            for keys in key_sets:
                pipe.exists(*keys)

        counts = self._pipelined(add)
        return [count == len(keys) for count, keys in zip(counts, key_sets)]

    def _put_many(self, items: Sequence[tuple[str, Buffer]]) -> None:
        if self.ttl_s is None and not self.is_cluster:  # one MSET: no per-command overhead
            _call(lambda: self._get_client().mset(dict(items)))
            return
        px = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))

        def add(pipe) -> None:
            for key, value in items:
                pipe.set(key, value, px=px)

        self._pipelined(add)

    def _get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        if not self.is_cluster:
            return _call(lambda: self._get_client().mget(keys))

        def add(pipe) -> None:
            for key in keys:
                pipe.get(key)

        return self._pipelined(add)

    def _delete_many(self, keys: Sequence[str]) -> None:
        def add(pipe) -> None:
            for key in keys:
                pipe.delete(key)

        self._pipelined(add)

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None
