"""Backends against a real redis-server and a directory; config validation; the lookup rule."""

from __future__ import annotations

import os
import socket
import time

import pytest

from pagedkv.kv_transfer.store.backends import StoreError, StoreUnavailable, create_backend
from pagedkv.kv_transfer.store.config import StoreConfig
from pagedkv.kv_transfer.store.connector import longest_stored_prefix
from pagedkv.kv_transfer.store.recent_keys import RecentKeys
from tests.kv_transfer.store.conftest import backend_for
from tests.ports import free_port


def test_batched_calls_round_trip(store_url) -> None:
    backend = backend_for(store_url)
    value = bytearray(os.urandom(300_000))
    backend.put_many([("a", memoryview(value)), ("b", b"small")])
    assert backend.exists_many(["a", "missing", "b"]) == [True, False, True]
    got = backend.get_many(["b", "missing", "a"])
    assert bytes(got[0]) == b"small" and got[1] is None and bytes(got[2]) == value
    backend.delete_many(["a", "missing"])
    assert backend.exists_many(["a", "b"]) == [False, True]
    assert backend.exists_many([]) == [] and backend.get_many([]) == []
    backend.close()


def test_redis_values_expire_after_ttl_s(redis_server) -> None:
    backend = create_backend(StoreConfig(store_url=redis_server.url, ttl_s=30))
    backend.put_many([("k", b"v")])
    assert 0 < redis_server.client().pttl("k") <= 30_000
    backend.close()


def test_file_values_older_than_ttl_s_are_missing(tmp_path) -> None:
    backend = create_backend(StoreConfig(store_url=f"file://{tmp_path}", ttl_s=60))
    backend.put_many([("old", b"1"), ("new", b"2")])
    past = time.time() - 120
    os.utime(backend.path_of("old"), (past, past))
    assert backend.exists_many(["old", "new"]) == [False, True]
    assert backend.get_many(["old", "new"]) == [None, b"2"]
    assert not list(tmp_path.rglob("*.tmp"))  # writes went through a temp file + rename


def test_a_silent_store_costs_one_timeout_then_fails_fast() -> None:
    """A server that accepts but never answers: the first call waits for its timeout, the
    next ones fail at once while the circuit breaker is open."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        backend = create_backend(StoreConfig(store_url=url, timeout_s=0.3))
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            backend.exists_many(["k"])
        assert 0.25 < time.monotonic() - t0 < 3
        t0 = time.monotonic()
        for _ in range(10):
            with pytest.raises(StoreUnavailable, match="retrying in"):
                backend.get_many(["k"])
        assert time.monotonic() - t0 < 1  # ten waits for the timeout would take 3 s
        backend.close()


def test_redis_down_is_unavailable_not_a_crash() -> None:
    backend = create_backend(StoreConfig(store_url=f"redis://127.0.0.1:{free_port()}/0"))
    with pytest.raises(StoreUnavailable):
        backend.put_many([("k", b"v")])
    assert backend.breaker.is_open


def test_cluster_url_builds_lazily_and_fails_as_a_store_error(redis_server) -> None:
    """Only construction can be tested here (no Redis Cluster): the client is built on first
    use, and a server without cluster mode is a store error, never an exception escaping."""
    port = redis_server.port
    backend = create_backend(StoreConfig(store_url=f"redis+cluster://127.0.0.1:{port}"))
    assert backend.is_cluster
    with pytest.raises(StoreError):
        backend.exists_many(["k"])


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:abc/0",
        "redis://127.0.0.1:99999/0",
        "redis://127.0.0.1:6379/0?socket_timeout=abc",
        "redis+cluster://127.0.0.1:abc",
    ],
)
def test_a_malformed_redis_url_fails_at_construction(url) -> None:
    """Not at the first call, on the engine thread: redis-py parses the URL when the client is
    built (without connecting), and the backend builds it at startup."""
    with pytest.raises(ValueError, match="kv_connector_extra_config.store_url"):
        create_backend(StoreConfig(store_url=url))


def test_an_unexpected_exception_from_the_redis_client_is_a_store_error(
    redis_server, monkeypatch
) -> None:
    backend = create_backend(StoreConfig(store_url=redis_server.url))
    client = backend._get_client()

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the client")

    for name in ("pipeline", "mset", "mget"):
        monkeypatch.setattr(client, name, broken)
    for call in (
        lambda: backend.exists_many(["k"]),
        lambda: backend.put_many([("k", b"v")]),
        lambda: backend.get_many(["k"]),
        lambda: backend.delete_many(["k"]),
    ):
        with pytest.raises(StoreError, match="RuntimeError: a bug in the client"):
            call()
    assert not backend.breaker.is_open  # an error, not an unreachable store
    backend.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "needs kv_connector_extra_config.store_url"),
        ({"store_url": "memcached://x"}, "unknown scheme"),
        ({"store_url": "localhost:6379"}, "must be a URL"),
        ({"store_url": "file://"}, "needs a directory"),
        ({"store_url": "redis://h", "load_mode": "lazy"}, "load_mode"),
        ({"store_url": "redis://h", "ttl_s": 0}, "ttl_s"),
        ({"store_url": "redis://h", "put_queue_mb": -1}, "put_queue_mb"),
        ({"store_url": "redis://h", "fsync": "yes"}, "fsync"),
        ({"store_url": "redis://h", "storeurl": "x"}, "unknown StoreConnector option"),
    ],
)
def test_bad_extra_config_is_a_clear_error(extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        StoreConfig.from_extra_config(extra)


def test_longest_stored_prefix_needs_only_the_window_of_sliding_groups() -> None:
    full = [True, True, False, True]
    sliding = [False, True, True, True]  # window of 1 block
    assert longest_stored_prefix([full], [None]) == 2
    assert longest_stored_prefix([sliding], [1]) == 4
    assert longest_stored_prefix([full, sliding], [None, 1]) == 2
    assert longest_stored_prefix([full, [True, False, True, True]], [None, 1]) == 1
    assert longest_stored_prefix([[False] * 3, [True] * 3], [None, 1]) == 0


def test_recent_keys_forget_old_and_least_recent_entries() -> None:
    recent = RecentKeys(capacity=2, max_age_s=60)
    recent.add_many(["a", "b", "c"])
    assert "a" not in recent and "b" in recent and "c" in recent
    recent.discard_many(["b"])
    assert "b" not in recent
    stale = RecentKeys(max_age_s=0)
    stale.add_many(["x"])
    time.sleep(0.01)
    assert "x" not in stale
