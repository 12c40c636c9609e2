"""Churn over HTTP: ``pagedkv proxy`` and one P stay up while 4 D instances in turn start,
serve requests through the proxy and stop, by SIGKILL and SIGTERM alternately. Every answer
equals a single instance's; P's listening sockets, threads and file descriptors come back to
where they were before the first D; P is at rest; a SIGTERMed D exits 0 and leaves
``/instances`` within 3 s. (Before, P kept one pair group, with its gloo listener, threads
and sockets, per departed D.)
"""

from __future__ import annotations

import signal
import time

from tests.kv_transfer.conftest import MAX_TOKENS, complete
from tests.kv_transfer.test_p2p_lifecycle import steady_footprint, wait_for_footprint
from tests.load_check import assert_at_rest
from tests.tiny_models import random_prompt

NUM_D = 4


def _wait_gone(proxy, engine_id: str, timeout_s: float) -> float:
    """Seconds until ``engine_id`` left the proxy's /instances (inf: it did not)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        live = proxy.instances()
        if engine_id not in {i["engine_id"] for i in live["prefill"] + live["decode"]}:
            return time.monotonic() - t0
        time.sleep(0.1)
    return float("inf")


def test_d_instances_come_and_go_under_one_p_and_the_proxy(cluster_factory, reference_text):
    """The next D boots while the current one serves (as in a scale-out), then the current
    one goes; P's footprint is compared once all four are gone (each D that left
    a pair group, a thread or a socket behind would show four times over)."""
    cluster = cluster_factory()
    proxy = cluster.proxy()
    fast = {"peer_timeout_s": 2.0, "lease_s": 3.0}
    p, _ = cluster.serve("P", "kv_producer", proxy, **fast)
    cluster.ready(p)
    proxy.wait_for_instances(1, 0)
    p.assert_alive()  # a plain request first: torch's thread pools, the server's connections
    http_port = int(p.base_url.rsplit(":", 1)[1])
    rest = steady_footprint(p.process.pid, http_port=http_port)
    prompts = [random_prompt(30 + 7 * i, seed=3000 + i) for i in range(2 * NUM_D)]
    expected = reference_text(prompts, MAX_TOKENS)
    sigterm_outcomes = []
    booting, _ = cluster.serve("D-0", "kv_consumer", proxy, **fast)
    for i in range(NUM_D):
        d = booting
        cluster.ready(d)
        proxy.wait_for_instances(1, 1)  # the one before has gone
        if i < NUM_D - 1:
            booting, _ = cluster.serve(f"D-{i + 1}", "kv_consumer", proxy, **fast)
        client = proxy.client()
        mine = [2 * i, 2 * i + 1]
        texts = [complete(client, prompts[j], stream=j % 2 == 1) for j in mine]
        assert texts == [expected[j] for j in mine], f"D-{i}"
        assert_at_rest([p.base_url, d.base_url])
        if i % 2:
            d.process.send_signal(signal.SIGKILL)
            d.process.wait(timeout=10)
            assert _wait_gone(proxy, f"D-{i}", timeout_s=15) < 15
        else:
            d.process.send_signal(signal.SIGTERM)
            gone_s = _wait_gone(proxy, f"D-{i}", timeout_s=15)
            sigterm_outcomes.append((d.process.wait(timeout=60), round(gone_s, 1)))
    # P finds a killed D silent after peer_timeout_s; its DEALER flushes for lease_s.
    wait_for_footprint(p.process.pid, rest, timeout_s=30, http_port=http_port)
    assert_at_rest([p.base_url])
    assert p.metrics()["pagedkv:kv_transfer_pair_groups"] == 0
    assert all(code == 0 and gone_s <= 3 for code, gone_s in sigterm_outcomes), (
        f"SIGTERMed D: (exit status, seconds until it left /instances) {sigterm_outcomes}"
    )
