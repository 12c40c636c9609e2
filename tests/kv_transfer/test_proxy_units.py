"""The proxy's pieces in one process: registration and heartbeat expiry, routing, and the
answers it gives without any upstream (503, 401, 400)."""

from __future__ import annotations

import time

import pytest
import zmq
from fastapi.testclient import TestClient

from pagedkv.entrypoints.openai.registration_client import RegistrationClient
from pagedkv.entrypoints.proxy.app import build_proxy_app
from pagedkv.entrypoints.proxy.registry import Instance, InstanceRegistry
from pagedkv.entrypoints.proxy.router import Router
from pagedkv.entrypoints.proxy.upstream import ProxyConfig
from pagedkv.entrypoints.serving.registration import Register, registry_codec
from pagedkv.transport.codec import ProtocolError
from pagedkv.transport.peer_addr import PeerAddr
from tests.kv_transfer.wire import raw_frames
from tests.ports import free_port

SECRET = b"registry-secret"
ME = PeerAddr("d0", "127.0.0.1", 4242)


def info(role: str, fingerprint: str = "fp", running: int = 0) -> Register:
    return Register(role, "http://127.0.0.1:1", "m", fingerprint, num_running=running)


class FakeRegistry:
    def __init__(self, instances: list[Instance]) -> None:
        self.instances = instances

    def live(self) -> list[Instance]:
        return list(self.instances)


def instance(name: str, role: str, **kw) -> Instance:
    return Instance(PeerAddr(name, "127.0.0.1", 1), info(role, **kw), time.monotonic())


def wait_until(condition, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


# ---------------------------------------------------------------------------- routing
def test_round_robin_cycles_through_each_role() -> None:
    registry = FakeRegistry(
        [instance(n, "kv_producer") for n in ("p0", "p1", "p2")]
        + [instance(n, "kv_consumer") for n in ("d0", "d1")]
    )
    router = Router(registry, "round_robin")  # type: ignore[arg-type]
    routes = [router.route() for _ in range(6)]
    assert [(r.p.engine_id, r.d.engine_id) for r in routes] == [
        ("p0", "d0"), ("p1", "d1"), ("p2", "d0"), ("p0", "d1"), ("p1", "d0"), ("p2", "d1"),
    ]  # fmt: skip


def test_least_loaded_prefers_fewest_in_flight_then_reported_load() -> None:
    registry = FakeRegistry(
        [instance("p0", "kv_producer", running=5), instance("p1", "kv_producer")]
        + [instance("d0", "kv_consumer"), instance("d1", "kv_consumer")]
    )
    router = Router(registry, "least_loaded")  # type: ignore[arg-type]
    d, p, _ = router.route()
    assert (p.engine_id, d.engine_id) == ("p1", "d0")
    router.acquire(d)
    router.acquire(p)
    d, p, _ = router.route()
    assert (p.engine_id, d.engine_id) == ("p0", "d1")  # p1 now has one in flight
    router.release(p)


def test_only_compatible_instances_pair_and_failed_ones_are_skipped() -> None:
    registry = FakeRegistry(
        [instance("p0", "kv_producer", fingerprint="a"), instance("d0", "kv_consumer")]
        + [instance("p1", "kv_producer"), instance("both", "kv_both", fingerprint="b")]
    )
    router = Router(registry, "round_robin")  # type: ignore[arg-type]
    for _ in range(4):
        d, p, _ = router.route()
        assert p.info.fingerprint == d.info.fingerprint and p.engine_id != d.engine_id
    assert router.route(exclude={"p1"}) is None  # d0 needs fingerprint "fp": only p1
    with pytest.raises(ValueError, match="routing"):
        Router(registry, "random")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- registry
def test_instances_register_and_drop_out_when_heartbeats_stop() -> None:
    port = free_port()
    registry = InstanceRegistry("127.0.0.1", port, SECRET, timeout_s=3)
    registry.start()
    me = PeerAddr("d0", "127.0.0.1", 4242)
    client = RegistrationClient(
        "127.0.0.1", port, me, lambda: info("kv_consumer"), SECRET, interval_s=0.1
    )
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    try:
        client.start()
        wait_until(lambda: [i.kv for i in registry.live()] == [me])
        # Without the secret nobody can register (and then receive prompts).
        rogue.connect(f"tcp://127.0.0.1:{port}")
        unsigned = registry_codec(None).encode(info("kv_consumer"), PeerAddr("x", "h", 1))
        rogue.send_multipart(unsigned)
        wait_until(lambda: registry.rejected.get("auth_mismatch") == 1)
        assert [i.engine_id for i in registry.live()] == ["d0"]
        # A clean stop says goodbye: gone at once.
        client.close()
        wait_until(lambda: not registry.live(), timeout_s=2)  # well before the 3 s timeout
        # Heartbeats stop without a goodbye (a crash): gone after the timeout.
        crashed = PeerAddr("d1", "127.0.0.1", 4243)
        rogue.send_multipart(registry_codec(SECRET).encode(info("kv_consumer"), crashed))
        wait_until(lambda: [i.kv for i in registry.live()] == [crashed])
        t0 = time.monotonic()
        wait_until(lambda: not registry.live(), timeout_s=15)
        assert time.monotonic() - t0 > 1  # only once heartbeats were missed for the timeout
    finally:
        rogue.close(linger=0)
        ctx.term()
        client.close()
        registry.close()


def test_registrations_the_proxy_could_not_use_are_refused() -> None:
    """A registered URL httpx can't parse made every request routed there a 500; a wrong
    role or key never pairs. All are refused at the registry: the proxy answers 503."""
    port = free_port()
    registry = InstanceRegistry("127.0.0.1", port, SECRET, timeout_s=5)
    registry.start()
    codec = registry_codec(SECRET)
    good = {"role": "kv_consumer", "http_url": "http://127.0.0.1:1", "model": "m",
            "fingerprint": "fp"}  # fmt: skip
    bad = [
        {**good, "http_url": "http://h:x"},  # httpx.InvalidURL
        {**good, "http_url": "http://a\nb"},
        {**good, "http_url": "ftp://h"},
        {**good, "http_url": "/relative"},
        {**good, "role": "kv_everything"},
        {**good, "num_running": -1},
    ]
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        for i, payload in enumerate(bad):
            dealer.send_multipart(raw_frames(codec, "register", payload, (f"d{i}", "h", 1)))
        wrong_key = registry_codec(b"not the secret").encode(info("kv_consumer"), ME)
        dealer.send_multipart(wrong_key)
        dealer.send_multipart(raw_frames(codec, "register", good, ("p", "h", 1)))
        wait_until(lambda: registry.live())
        wait_until(lambda: registry.rejected.get("malformed", 0) == len(bad))
        assert registry.rejected.get("unauthenticated") == 1
        assert [i.engine_id for i in registry.live()] == ["p"]
    finally:
        dealer.close(linger=0)
        ctx.term()
        registry.close()


def test_the_registry_tracks_a_bounded_number_of_instances(monkeypatch) -> None:
    from pagedkv.entrypoints.proxy import registry as registry_module

    monkeypatch.setattr(registry_module, "MAX_INSTANCES", 3)
    now = [1000.0]  # the registry's clock, moved by hand
    monkeypatch.setattr(registry_module.time, "monotonic", lambda: now[0])
    registry = InstanceRegistry("127.0.0.1", free_port(), None, timeout_s=0.3)
    for i in range(5):
        registry._on_register(PeerAddr(f"d{i}", "127.0.0.1", 1), info("kv_consumer"))
    assert len(registry.live()) == 3 and registry.num_refused == 2
    now[0] += 0.4  # the three go stale: a newcomer takes a place
    registry._on_register(PeerAddr("late", "127.0.0.1", 1), info("kv_consumer"))
    assert [i.engine_id for i in registry.live()] == ["late"]
    registry.close()


# ---------------------------------------------------------------------------- the app alone
@pytest.fixture
def lone_proxy():
    registry = InstanceRegistry("127.0.0.1", free_port(), None, timeout_s=5)
    app = build_proxy_app(registry, Router(registry), ProxyConfig(api_key="k"))
    with TestClient(app) as client:
        yield client


def test_no_instance_is_a_clear_503(lone_proxy) -> None:
    auth = {"Authorization": "Bearer k"}
    r = lone_proxy.post("/v1/completions", json={"prompt": "w1", "max_tokens": 2}, headers=auth)
    assert r.status_code == 503
    message = r.json()["error"]["message"]
    assert "no instance is available: 0 prefill, 0 decode and 0 replica" in message
    assert lone_proxy.get("/v1/models", headers=auth).status_code == 503
    assert lone_proxy.get("/health").json() == {"replica": 0, "prefill": 0, "decode": 0}


def test_the_proxy_checks_its_api_key_and_the_body(lone_proxy) -> None:
    r = lone_proxy.post("/v1/completions", json={"prompt": "w1"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    for wrong in ("Bearer K", "Bearer k ", "k", "Basic k"):
        r = lone_proxy.post(
            "/v1/completions", json={"prompt": "w1"}, headers={"Authorization": wrong}
        )
        assert r.status_code == 401, wrong
    assert lone_proxy.get("/instances").status_code == 401
    assert lone_proxy.get("/v1/models").status_code == 401
    from pagedkv.entrypoints.openai.cli_args import DEFAULT_MAX_BODY_BYTES

    huge = b'{"prompt": "' + b"w1 " * (DEFAULT_MAX_BODY_BYTES // 3 + 1) + b'"}'
    r = lone_proxy.post("/v1/completions", content=huge, headers={"Authorization": "Bearer k"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    auth = {"Authorization": "Bearer k", "Content-Type": "application/json"}
    r = lone_proxy.post("/v1/chat/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert lone_proxy.post("/v1/completions", json=[1], headers=auth).status_code == 400


# ---------------------------------------------------------------------------- misconfiguration
@pytest.mark.parametrize(("proxy_secret", "instance_secret"), [(None, SECRET), (SECRET, None)])
def test_a_secret_on_one_side_only_is_refused_and_both_sides_say_so(
    proxy_secret, instance_secret, caplog
) -> None:
    """Once a proxy without a secret accepted a signing instance's registration (and paired it
    with instances that could not talk to it). Now the registration is refused, the refusal
    is listed in ``/instances`` under the engine id the sender claims, and the proxy and the
    instance each log an authentication mismatch."""
    port = free_port()
    registry = InstanceRegistry("127.0.0.1", port, proxy_secret, timeout_s=5)
    client = RegistrationClient(
        "127.0.0.1", port, ME, lambda: info("kv_consumer"), instance_secret, interval_s=0.1
    )
    app = build_proxy_app(registry, Router(registry), ProxyConfig())
    try:
        with caplog.at_level("WARNING"), TestClient(app) as proxy:
            client.start()
            wait_until(lambda: isinstance(client.last_answer, ProtocolError))
            assert client.last_answer.reason == "auth_mismatch"
            (refused,) = proxy.get("/instances").json()["refused"]
            assert refused["claimed_engine_id"] == "d0"
            assert "authentication mismatch" in refused["reason"]
            assert registry.live() == []
    finally:
        client.close()
        registry.close()
    loggers = {r.name for r in caplog.records if "authentication mismatch" in r.getMessage()}
    assert loggers == {
        "pagedkv.transport.control_plane",
        "pagedkv.entrypoints.openai.registration_client",
    }


def test_instances_that_cannot_pair_are_told_listed_and_named_in_the_503() -> None:
    """Once a D with another dtype registered, /health showed one P and one D, and every
    request got an instant 503 "no pair is available" that nobody could explain. Now the
    instance is told at registration, /instances says why, and so does the 503."""
    port = free_port()
    registry = InstanceRegistry("127.0.0.1", port, SECRET, timeout_s=5)
    layouts = {"p0": ("fp-a", "llama; float32; block_size 16"),
               "d0": ("fp-b", "llama; bfloat16; block_size 16")}  # fmt: skip
    clients = [
        RegistrationClient(
            "127.0.0.1", port, PeerAddr(name, "127.0.0.1", 4242 + i),
            lambda r=role, f=fp, lay=layout: Register(r, "http://127.0.0.1:1", "m", f,
                                                      kv_layout=lay, signs=True),
            SECRET, interval_s=0.1,
        )
        for i, (name, role, (fp, layout)) in enumerate(
            [("p0", "kv_producer", layouts["p0"]), ("d0", "kv_consumer", layouts["d0"])]
        )
    ]  # fmt: skip
    app = build_proxy_app(registry, Router(registry), ProxyConfig())
    try:
        with TestClient(app) as proxy:
            for client in clients:
                client.start()
            wait_until(lambda: len(registry.live()) == 2)
            # Told at registration (a heartbeat after both were in):
            wait_until(lambda: "float32" in getattr(clients[1].last_answer, "note", ""))
            assert "bfloat16" in clients[1].last_answer.note
            decode = proxy.get("/instances").json()["decode"][0]
            assert "no prefill instance has its model and KV layout" in decode["pairing"]
            assert decode["kv_layout"] == layouts["d0"][1] and decode["signs"] is True
            r = proxy.post("/v1/completions", json={"prompt": "w1", "max_tokens": 2})
            assert r.status_code == 503
            message = r.json()["error"]["message"]
            assert "d0" in message and "bfloat16" in message and "float32" in message
    finally:
        for client in clients:
            client.close()
