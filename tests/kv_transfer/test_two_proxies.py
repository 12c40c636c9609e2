"""Two ``pagedkv proxy`` processes in front of the same instances: a replica registered with
``--registry A,B`` and a 1P1D pair with ``kv_connector_extra_config.proxies``. Proxy A is
SIGKILLed while several threads send a bounded load through proxy B (the real ``openai``
client), and restarted on its ports: no request to B fails (every answer equals a single
instance's), and A lists every live instance within one heartbeat (plus slack), then serves.
Before, an instance registered with one proxy only, so the proxy was a single point of
failure; ``proxy_addresses`` reads the lists (the ``--registry`` flag's parse test is in
``tests/entrypoints/test_cli.py``)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from pagedkv.entrypoints.openai.registration_client import RegistrationClient, proxy_addresses
from pagedkv.entrypoints.proxy.registry import InstanceRegistry
from pagedkv.entrypoints.serving.registration import Register
from pagedkv.transport.peer_addr import PeerAddr
from tests.entrypoints.conftest import MODEL_NAME
from tests.kv_transfer.conftest import MAX_TOKENS, complete
from tests.ports import free_port
from tests.tiny_models import random_prompt

NUM_THREADS = 4
REQUESTS_PER_THREAD = 8
#: A plain replica's heartbeat interval (``pagedkv serve``'s default); P and D beat every 0.5 s.
REPLICA_HEARTBEAT_S = 2.0
#: What a loaded 2-core machine may add to one heartbeat before the proxy has seen it.
SLACK_S = 8.0


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _load(proxy, prompts, expected, done: list, failures: list) -> list[threading.Thread]:
    """Threads that each send their share of ``prompts`` through ``proxy``, one at a time."""

    def run(thread: int) -> None:
        client = proxy.client()
        for i in range(thread, len(prompts), NUM_THREADS):
            try:
                text = complete(client, prompts[i], stream=i % 2 == 1)
                if text != expected[i]:
                    failures.append(f"request {i}: {text!r} != {expected[i]!r}")
            except Exception as e:  # noqa: BLE001  (every failure is reported, not just one)
                failures.append(f"request {i}: {type(e).__name__}: {e}")
            done.append(i)

    return [threading.Thread(target=run, args=(t,)) for t in range(NUM_THREADS)]


def test_one_proxy_restarts_while_the_other_serves_the_same_instances(
    cluster_factory, reference_text
) -> None:
    cluster = cluster_factory()
    a = cluster.proxy(name="proxy-A", instance_timeout=6.0)
    b = cluster.proxy(name="proxy-B", instance_timeout=6.0)
    both = [f"127.0.0.1:{a.registry_port}", f"127.0.0.1:{b.registry_port}"]
    replica = cluster.serve_plain("R0", "--registry", ",".join(both))
    p, _ = cluster.serve("P", "kv_producer", proxies=both)
    d, _ = cluster.serve("D", "kv_consumer", proxies=both)
    prompts = [
        random_prompt(20 + 3 * i, seed=4000 + i) for i in range(NUM_THREADS * REQUESTS_PER_THREAD)
    ]
    expected = reference_text(prompts, MAX_TOKENS)
    cluster.ready(replica, p, d)
    for proxy in (a, b):
        proxy.wait_for_instances(1, 1, num_replicas=1)

    done: list[int] = []
    failures: list[str] = []
    threads = _load(b, prompts, expected, done, failures)
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while len(done) < NUM_THREADS and time.monotonic() < deadline:
        time.sleep(0.05)
    a.process.send_signal(signal.SIGKILL)
    a.process.wait(timeout=10)
    killed_mid_load = len(done) < len(prompts)
    restarted = cluster.proxy(
        name="proxy-A-restarted",
        instance_timeout=6.0,
        port=_port(a.base_url),
        registry_port=a.registry_port,
    )
    t0 = time.monotonic()
    restarted.wait_for_instances(1, 1, num_replicas=1, timeout_s=REPLICA_HEARTBEAT_S + SLACK_S)
    relearned_s = time.monotonic() - t0
    for thread in threads:
        thread.join(timeout=120)
    assert killed_mid_load, "the load ended before proxy A was killed: send more requests"
    assert failures == [] and sorted(done) == list(range(len(prompts))), failures
    # A serves again: by the replica and by the pair (round robin over R0 and D).
    served_by = set()
    for i in range(4):
        raw = restarted.client().completions.with_raw_response.create(
            model=MODEL_NAME, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert raw.parse().choices[0].text == expected[i]
        served_by.add(raw.headers["x-pagedkv-instance"])
    assert served_by == {"D", f"127.0.0.1:{_port(replica.base_url)}"}, served_by
    print(f"restarted proxy A listed all 3 instances {relearned_s:.2f} s after it answered")


def test_proxy_addresses_read_the_cli_flag_or_the_connector_config() -> None:
    one = [("127.0.0.1", 30001)]
    two = [("127.0.0.1", 30001), ("proxy-b.local", 30002)]
    assert proxy_addresses(two, {"proxy_ip": "10.0.0.1", "proxy_port": 1}) == two  # flag wins
    assert proxy_addresses(None, {"proxies": ["127.0.0.1:30001", "proxy-b.local:30002"]}) == two
    assert proxy_addresses(None, {"proxies": "127.0.0.1:30001, proxy-b.local:30002"}) == two
    assert proxy_addresses(None, {"proxy_ip": "127.0.0.1", "proxy_port": 30001}) == one
    assert proxy_addresses(None, {"proxy_ip": "127.0.0.1", "proxy_port": "30001"}) == one
    assert proxy_addresses(None, {"send_type": "GET"}) == []


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"proxies": []}, "proxies must be a list"),
        ({"proxies": ["127.0.0.1:1", 2]}, "proxies must be a list"),
        ({"proxies": ["127.0.0.1"]}, "proxies: '127.0.0.1': not HOST:PORT"),
        ({"proxies": ["h:1", "h:1"]}, "proxies: 'h:1' is listed twice"),
        ({"proxies": ["h:1"], "proxy_ip": "h", "proxy_port": 2}, "not both"),
        ({"proxy_ip": "127.0.0.1"}, "proxy_ip and proxy_port go together"),
        ({"proxy_ip": "a b", "proxy_port": 1}, "proxy_ip/proxy_port: host must be"),
        ({"proxy_ip": "h", "proxy_port": 70000}, "proxy_ip/proxy_port: port must be"),
    ],
)
def test_proxy_addresses_name_the_bad_key(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"kv_connector_extra_config.*{message}"):
        proxy_addresses(None, extra)


def test_a_restarted_registry_hears_an_instance_from_its_next_heartbeat() -> None:
    """Every heartbeat is a whole registration: a proxy that lost its state (a restart on the
    same port) knows the instance again after one heartbeat; a proxy that is down meanwhile
    costs the other proxy's heartbeats nothing."""
    port, down_port = free_port(), free_port()
    me = PeerAddr("r0", "127.0.0.1", 4242)
    info = Register("plain", "http://127.0.0.1:1", "m", "fp")
    clients = [
        RegistrationClient("127.0.0.1", p, me, lambda: info, None, interval_s=0.2)
        for p in (down_port, port)
    ]
    registry = InstanceRegistry("127.0.0.1", port, None, timeout_s=5)
    try:
        registry.start()
        for client in clients:
            client.start()
        _wait(lambda: [i.kv for i in registry.live()] == [me], timeout_s=10)
        assert clients[0].last_answer is None  # nothing listens on down_port
        registry.close()
        time.sleep(0.5)  # heartbeats sent meanwhile reach nobody
        registry = InstanceRegistry("127.0.0.1", port, None, timeout_s=5)
        registry.start()
        _wait(lambda: [i.kv for i in registry.live()] == [me], timeout_s=0.2 + SLACK_S)
    finally:
        for client in clients:
            client.close()
        registry.close()


def _wait(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        time.sleep(0.02)
