"""The store deployments over HTTP: two kv_both ``pagedkv serve`` instances sharing a
redis-server, under load, and with Redis stopped in the middle of a load; two sharing a
``mooncake_master`` (each lending a segment of its memory)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from tests.kv_transfer.conftest import Cluster, complete, total
from tests.kv_transfer.store.conftest import (
    MooncakeMaster,
    RedisServer,
    free_port,
    require_redis_server,
    store_kv_config,
)
from tests.load_check import assert_at_rest, short_load
from tests.tiny_models import random_prompt


@pytest.fixture(scope="module")
def store_pair(tiny_model, tmp_path_factory):
    require_redis_server()
    redis = RedisServer(free_port())
    redis.start()
    cluster = Cluster(tiny_model, tmp_path_factory.mktemp("store-http"))
    try:
        config = store_kv_config(redis.url, "kv_both")
        a, b = cluster.serve_config("A", config), cluster.serve_config("B", config)
        cluster.ready(a, b)
        servers = {"A": a, "B": b}
        yield SimpleNamespace(redis=redis, a=a, b=b, servers=servers, urls=[a.base_url, b.base_url])
    finally:
        cluster.close()
        redis.stop()


def test_two_store_instances_under_load_share_blocks_and_come_back_to_rest(store_pair) -> None:
    """4 clients for 3 s, requests alternating between A and B, 15 prompts reused in turn (so
    each prompt visits A and B by turns): each answered exactly once; blocks one instance
    computed were loaded from Redis by the other; both end at rest."""
    short_load(store_pair.urls, store_pair.urls, num_prompts=15)
    assert store_pair.redis.client().dbsize() > 0  # blocks were stored ...
    loaded = total(store_pair.servers, "AB", "pagedkv:kv_transfer_num_blocks_loaded_total")
    assert loaded > 0  # ... and loaded by the instance that had not computed them


def test_redis_stopped_mid_load_costs_recompute_not_requests(store_pair, reference_text) -> None:
    """Redis dies 1 s into a 4 s load: every request is still answered exactly once (the
    store is a cache: a failed put is dropped, a failed lookup or load is a miss), greedy
    outputs stay exact, and both instances come back to rest. The failures are visible: the
    lookups and their errors are on /metrics (once they were not exported at all), and each
    kind of failure is logged at WARNING (once only at DEBUG)."""

    def failures() -> float:
        names = ("num_put_failures", "num_load_errors", "num_lookup_errors")
        return sum(total(store_pair.servers, "AB", f"pagedkv:kv_transfer_{n}_total") for n in names)

    before = failures()
    lookups = total(store_pair.servers, "AB", "pagedkv:kv_transfer_num_lookups_total")
    assert lookups > 0  # the earlier test's load looked blocks up
    stopper = threading.Timer(1.0, store_pair.redis.stop)
    stopper.start()
    t0 = time.monotonic()
    try:
        # Fresh prompts throughout: every request looks up and stores blocks.
        short_load(store_pair.urls, store_pair.urls, seconds=4, num_prompts=1000, seed=1)
    finally:
        stopper.join()
    assert time.monotonic() - t0 < 60
    assert failures() > before  # Redis was down under the instances' feet
    errors = total(store_pair.servers, "AB", "pagedkv:kv_transfer_num_lookup_errors_total")
    assert errors > 0  # requests admitted while it was down could not look up
    logs = store_pair.a.log_path.read_text() + store_pair.b.log_path.read_text()
    assert "WARNING pagedkv.kv_transfer.store" in logs and "store lookup failed" in logs
    prompts = [random_prompt(n, seed=500 + n) for n in (20, 45)]
    expected = reference_text(prompts, 8)
    for server in (store_pair.a, store_pair.b):
        assert [complete(server.client(), p, stream=False) for p in prompts] == expected
    assert_at_rest(store_pair.urls)


def test_two_servers_share_blocks_through_mooncake(
    tiny_model, tmp_path_factory, reference_text
) -> None:
    """A computes two prompts, B answers them with the blocks A stored (identical greedy text,
    streamed), and B's /metrics counts exactly those blocks as loaded."""
    log_dir = tmp_path_factory.mktemp("mooncake-http")
    master = MooncakeMaster(log_dir / "mooncake_master.log")
    master.start()
    cluster = Cluster(tiny_model, log_dir)
    try:
        config = store_kv_config(master.url, "kv_both")
        a, b = cluster.serve_config("A", config), cluster.serve_config("B", config)
        cluster.ready(a, b)
        prompts = [random_prompt(n, seed=700 + n) for n in (40, 70)]
        expected = reference_text(prompts, 8)
        # A answers once its blocks are stored (a finished request holds them until then).
        assert [complete(a.client(), p, stream=False) for p in prompts] == expected
        assert [complete(b.client(), p, stream=True) for p in prompts] == expected
        # The blocks before each prompt's last token: (40 - 1) // 16 + (70 - 1) // 16.
        assert b.metrics()["pagedkv:kv_transfer_num_blocks_loaded_total"] == 2 + 4
        assert b.metrics()["pagedkv:kv_transfer_num_load_errors_total"] == 0
    finally:
        cluster.close()
        master.stop()
