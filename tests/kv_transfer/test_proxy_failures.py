"""The proxy's failure paths against fake P and D servers (uvicorn in threads, real sockets):
retries before the first byte, 4xx passed through, an error event after it, no hang."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedkv.entrypoints.openai.registration_client import RegistrationClient
from pagedkv.entrypoints.proxy.app import build_proxy_app
from pagedkv.entrypoints.proxy.pd_proxy import PDProxy
from pagedkv.entrypoints.proxy.registry import InstanceRegistry
from pagedkv.entrypoints.proxy.router import Router
from pagedkv.entrypoints.proxy.upstream import ProxyConfig
from pagedkv.entrypoints.serving.registration import Register
from pagedkv.transport.peer_addr import PeerAddr
from tests.ports import free_port


def fake_instance(behaviour: str, seen: list[dict]) -> FastAPI:
    """A P or D that answers ``behaviour``: ok | error500 | error400 | hang | die_mid_stream.
    A hanging one notes when the proxy closes the connection (a real instance aborts then)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        headers = request.headers
        seen.append({**body, "x-request-id": headers.get("x-request-id"),
                     "authorization": headers.get("authorization")})  # fmt: skip
        if behaviour == "error500":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if behaviour == "error400":
            return JSONResponse({"error": {"message": "prompt too long"}}, status_code=400)
        if behaviour == "hang":
            for _ in range(600):
                if await request.is_disconnected():
                    seen[-1]["disconnected"] = True
                    return JSONResponse({}, status_code=499)
                await asyncio.sleep(0.05)
        if "do_remote_prefill" in body.get("kv_transfer_params", {}):
            await asyncio.sleep(0.3)  # a real D answers once P's KV has arrived
        text = {"choices": [{"text": " w1", "finish_reason": None}]}
        if not body.get("stream"):
            return JSONResponse({"choices": [{"text": " w1 w2", "finish_reason": "length"}]})

        async def events():
            yield f"data: {json.dumps(text)}\n\n"
            if behaviour == "die_mid_stream":
                raise RuntimeError("the decode instance crashed")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class Upstreams:
    """Fake instances, each a uvicorn server on a thread, registered with the registry."""

    def __init__(self, registry_port: int) -> None:
        self.registry_port = registry_port
        self.servers: list[uvicorn.Server] = []
        self.clients: list[RegistrationClient] = []
        self.seen: dict[str, list[dict]] = {}

    def add(self, name: str, role: str, behaviour: str) -> None:
        port = free_port()
        self.seen[name] = []
        config = uvicorn.Config(
            fake_instance(behaviour, self.seen[name]), host="127.0.0.1", port=port,
            log_level="warning",
        )  # fmt: skip
        server = uvicorn.Server(config)
        threading.Thread(target=server.run, daemon=True).start()
        self.servers.append(server)
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        info = Register(role, f"http://127.0.0.1:{port}", "m", "fp")
        client = RegistrationClient(
            "127.0.0.1", self.registry_port, PeerAddr(name, "127.0.0.1", 1), lambda: info, None, 0.2
        )
        client.start()
        self.clients.append(client)

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for server in self.servers:
            server.should_exit = True


@pytest.fixture
def proxy_with() -> Iterator:
    """``proxy_with({name: (role, behaviour)})`` -> (TestClient of the proxy, requests seen)."""
    made = []

    def make(instances: dict[str, tuple[str, str]], **config_changes):
        registry_port = free_port()
        registry = InstanceRegistry("127.0.0.1", registry_port, None, timeout_s=5)
        config = ProxyConfig(request_timeout_s=30.0, connect_timeout_s=5.0, max_attempts=3)
        config = dataclasses.replace(config, **config_changes)
        app = build_proxy_app(registry, Router(registry), config)
        from fastapi.testclient import TestClient

        client = TestClient(app)
        client.__enter__()
        upstreams = Upstreams(registry_port)
        made.append((client, upstreams))
        for name, (role, behaviour) in instances.items():
            upstreams.add(name, role, behaviour)
        deadline = time.monotonic() + 10
        while len(registry.live()) < len(instances):
            assert time.monotonic() < deadline, "fake instances did not register"
            time.sleep(0.02)
        return client, upstreams.seen

    yield make
    for client, upstreams in made:
        upstreams.close()
        client.__exit__(None, None, None)


BODY = {"prompt": [5, 6, 7], "max_tokens": 4}


def wait_until(condition, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_failing_prefill_is_retried_on_another_pair_with_a_fresh_transfer(proxy_with):
    client, seen = proxy_with(
        {"p-bad": ("kv_producer", "error500"), "p-good": ("kv_producer", "ok"),
         "d": ("kv_consumer", "ok")}
    )  # fmt: skip
    for i in range(2):  # round robin (a retry takes a turn): both start on the bad P
        r = client.post("/v1/completions", json=BODY, headers={"X-Request-Id": f"c{i}"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " w1 w2"
    # D got the client's request id (a retry's suffixed: never the aborted attempt's id).
    assert [b["x-request-id"] for b in seen["d"]] == ["c0", "c0-retry1", "c1", "c1-retry1"]
    assert (len(seen["p-bad"]), len(seen["p-good"]), len(seen["d"])) == (2, 2, 4)
    # P got max_tokens=1 and D's KV address; D got the original request and P's.
    for p_body in seen["p-good"] + seen["p-bad"]:
        assert p_body["max_tokens"] == 1 and p_body["kv_transfer_params"]["do_remote_decode"]
        assert p_body["kv_transfer_params"]["remote_engine_id"] == "d"
    d_params = [b["kv_transfer_params"] for b in seen["d"]]
    assert all(b["max_tokens"] == 4 and "stream" not in b for b in seen["d"])
    assert sorted(p["remote_engine_id"] for p in d_params) == ["p-bad"] * 2 + ["p-good"] * 2
    # Each attempt had its own transfer id, shared by its P and D.
    assert len({p["transfer_id"] for p in d_params}) == 4
    p_ids = {b["kv_transfer_params"]["transfer_id"] for b in seen["p-good"] + seen["p-bad"]}
    assert p_ids == {p["transfer_id"] for p in d_params}


def test_a_hanging_decode_times_out_and_a_4xx_is_the_clients(proxy_with):
    client, seen = proxy_with(
        {"p": ("kv_producer", "ok"), "d-hang": ("kv_consumer", "hang"),
         "d-400": ("kv_consumer", "error400")},
        request_timeout_s=1.0,
    )  # fmt: skip
    t0 = time.monotonic()
    statuses = {client.post("/v1/completions", json=BODY).status_code for _ in range(2)}
    assert statuses == {400}  # the hanging D timed out (1 s) and the retry met the 4xx
    assert time.monotonic() - t0 < 20  # not the 600 s default


def test_no_hang_when_every_instance_fails_503(proxy_with):
    client, _ = proxy_with({"p": ("kv_producer", "error500"), "d": ("kv_consumer", "ok")})
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and "every attempt failed" in r.json()["error"]["message"]


def test_a_decode_dying_mid_stream_ends_the_stream_with_an_error_event(proxy_with):
    client, _ = proxy_with({"p": ("kv_producer", "ok"), "d": ("kv_consumer", "die_mid_stream")})
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0][6:])["choices"][0]["text"] == " w1"
    assert "failed mid-stream" in json.loads(events[1][6:])["error"]["message"]
    assert events[-1] == "data: [DONE]"


def test_clients_authenticate_to_the_proxy_and_the_proxy_to_the_instances(proxy_with):
    """Two keys: the client's (checked by the proxy, never forwarded) and the upstream one
    (sent to P and D, which check it: in the HTTP clusters every instance requires it)."""
    client, seen = proxy_with(
        {"p": ("kv_producer", "ok"), "d": ("kv_consumer", "ok")},
        api_key="client-key",
        upstream_api_key="upstream-key",
    )
    assert client.post("/v1/completions", json=BODY).status_code == 401
    r = client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer client-key"})
    assert r.status_code == 200
    assert [b["authorization"] for b in seen["p"] + seen["d"]] == ["Bearer upstream-key"] * 2


def test_a_decode_refusing_the_request_cancels_the_prefill(proxy_with):
    """D answers a 4xx while P still prefills: the client gets D's answer and P's request is
    cancelled (it once ran on, and P held the blocks until the lease expired)."""
    client, seen = proxy_with(
        {"p": ("kv_producer", "hang"), "d": ("kv_consumer", "error400")}, request_timeout_s=30
    )
    assert client.post("/v1/completions", json=BODY).status_code == 400
    wait_until(lambda: seen["p"] and seen["p"][0].get("disconnected"))
    wait_until(lambda: client.get("/instances").json()["in_flight"] == {})


def test_an_attempt_cancelled_midway_cancels_both_halves():
    """The attempt cancelled while P and D both still work (the client gone): both upstream
    requests are closed, so each instance aborts and frees, and nothing stays in flight. Both
    once ran on, D's answer opened and counted in flight forever."""
    registry_port = free_port()
    registry = InstanceRegistry("127.0.0.1", registry_port, None, timeout_s=5)
    registry.start()
    upstreams = Upstreams(registry_port)
    router = Router(registry)
    proxy = PDProxy(registry, router, ProxyConfig(request_timeout_s=30))

    async def cancel_midway() -> None:
        import httpx

        proxy.upstream.client = httpx.AsyncClient()
        route = router.route()
        assert route is not None
        pair = (route.p, route.d)
        body = {**BODY, "stream": True}
        attempt = asyncio.create_task(proxy._attempt("/v1/completions", body, *pair, True, None))
        for _ in range(500):
            if upstreams.seen["p"] and upstreams.seen["d"]:
                break
            await asyncio.sleep(0.02)
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        assert not router.in_flight
        await proxy.upstream.client.aclose()

    try:
        upstreams.add("p", "kv_producer", "hang")
        upstreams.add("d", "kv_consumer", "hang")
        wait_until(lambda: len(registry.live()) == 2)
        asyncio.run(cancel_midway())
        wait_until(lambda: all(upstreams.seen[n][0].get("disconnected") for n in ("p", "d")))
    finally:
        upstreams.close()
        registry.close()
