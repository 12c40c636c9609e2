"""The proxy against bodies it cannot forward and decode instances that do not answer: each is
a clear 4xx or 503 in OpenAI's format (never a 500, never a wait of the request timeout), and
nothing stays counted in flight."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from pagedkv.entrypoints.openai.registration_client import RegistrationClient
from pagedkv.entrypoints.proxy.app import build_proxy_app
from pagedkv.entrypoints.proxy.pd_proxy import PDProxy
from pagedkv.entrypoints.proxy.registry import Instance, InstanceRegistry
from pagedkv.entrypoints.proxy.router import Router
from pagedkv.entrypoints.proxy.upstream import ProxyConfig
from pagedkv.entrypoints.serving.registration import Register
from pagedkv.transport.peer_addr import PeerAddr
from tests.ports import free_port

BODY = {"prompt": [5, 6, 7], "max_tokens": 4}


def fake_instance(name: str, models: str, seen: list[dict]) -> FastAPI:
    """A P or D whose completions answer at once; its /v1/models answers (``ok``) or hangs
    until the proxy closes the connection (``hang``)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen.append(await request.json())
        return JSONResponse({"choices": [{"text": " w1", "finish_reason": "length"}]})

    @app.get("/v1/models")
    async def list_models(request: Request):
        if models == "hang":
            for _ in range(600):
                if await request.is_disconnected():
                    break
                await asyncio.sleep(0.05)
        return JSONResponse({"object": "list", "data": [{"id": f"model-of-{name}"}]})

    return app


def serve(app: FastAPI) -> uvicorn.Server:
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    wait_until(lambda: server.started)
    return server


@pytest.fixture
def proxy_with() -> Iterator:
    """``proxy_with({name: (role, models)}, **config)`` -> (TestClient of the proxy, requests
    each instance saw). Instances register in the order given."""
    servers: list[uvicorn.Server] = []
    registrations: list[RegistrationClient] = []
    clients: list[TestClient] = []

    def make(instances: dict[str, tuple[str, str]], **config_changes):
        registry_port = free_port()
        registry = InstanceRegistry("127.0.0.1", registry_port, None, timeout_s=5)
        config = ProxyConfig(request_timeout_s=30.0, connect_timeout_s=1.0)
        config = dataclasses.replace(config, **config_changes)
        app = build_proxy_app(registry, Router(registry, "least_loaded"), config)
        client = TestClient(app, raise_server_exceptions=False)  # a 500 is a status to assert
        client.__enter__()
        clients.append(client)
        seen: dict[str, list[dict]] = {}
        for name, (role, models) in instances.items():
            seen[name] = []
            servers.append(serve(fake_instance(name, models, seen[name])))
            info = Register(role, f"http://127.0.0.1:{servers[-1].config.port}", "m", "fp")
            me = PeerAddr(name, "127.0.0.1", 1)
            registrations.append(
                RegistrationClient("127.0.0.1", registry_port, me, lambda i=info: i, None, 0.2)
            )
            registrations[-1].start()
            wait_until(lambda n=name: n in {i.engine_id for i in registry.live()})
        return client, seen

    yield make
    for registration in registrations:
        registration.close()
    for server in servers:
        server.should_exit = True
    for client in clients:
        client.__exit__(None, None, None)


def wait_until(condition, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


PAIR = {"p": ("kv_producer", "ok"), "d": ("kv_consumer", "ok")}


@pytest.mark.parametrize(
    "body, message",
    [
        (b"[" * 100_000, "nested too deeply"),  # once: RecursionError, a 500
        (b'{"a": ' * 100_000, "nested too deeply"),
        (b'{"prompt": "\xff\xfe"}', "not valid JSON"),  # not UTF-8
        (b'{"prompt": [1, 2]', "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"a prompt"', "must be a JSON object"),
    ],
    ids=["deep-array", "deep-object", "not-utf8", "truncated", "empty", "array", "string"],
)
def test_a_body_that_is_not_a_json_object_is_a_400(proxy_with, body: bytes, message: str):
    client, seen = proxy_with(PAIR)
    r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert seen == {"p": [], "d": []}


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": NaN, "max_tokens": 4}',  # once: a 500, and D counted in flight forever
        b'{"prompt": [5, 6], "max_tokens": 4, "temperature": Infinity}',
        b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": -Infinity}}',
    ],
)
def test_nan_or_infinity_is_a_400_and_nothing_stays_in_flight(proxy_with, body: bytes):
    client, seen = proxy_with(PAIR)
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert "NaN and Infinity are not JSON numbers" in r.json()["error"]["message"]
    assert client.get("/instances").json()["in_flight"] == {}
    assert seen == {"p": [], "d": []}
    # The pair still serves (least_loaded routing is not skewed by the bad requests).
    assert client.post("/v1/completions", json=BODY).status_code == 200
    # P's answer may still be on its way when D's reaches the client: its count drains then.
    wait_until(lambda: client.get("/instances").json()["in_flight"] == {})


def test_a_decode_request_that_cannot_be_built_is_not_left_in_flight():
    """D's count is taken before its request is built: a request httpx refuses to encode once
    left it counted forever (skewing least_loaded). Driven past the handler's own check."""

    class Registry:
        def live(self) -> list[Instance]:
            return [
                Instance(
                    PeerAddr(name, "127.0.0.1", 1),
                    Register(role, "http://127.0.0.1:1", "m", "fp"),
                    time.monotonic(),
                )
                for name, role in (("p", "kv_producer"), ("d", "kv_consumer"))
            ]

    router = Router(Registry(), "least_loaded")  # type: ignore[arg-type]
    proxy = PDProxy(Registry(), router, ProxyConfig())  # type: ignore[arg-type]

    async def attempt() -> None:
        proxy.upstream.client = httpx.AsyncClient()
        route = router.route()
        assert route is not None
        pair = (route.p, route.d)
        body = {"prompt": float("nan")}
        try:
            with pytest.raises(ValueError, match="JSON compliant"):
                await proxy._attempt("/v1/completions", body, *pair, False, None)
        finally:
            await proxy.upstream.client.aclose()

    asyncio.run(attempt())
    assert dict(router.in_flight) == {}


def test_models_answers_from_the_first_instance_that_replies(proxy_with):
    """A hung D (asked first) does not hold /v1/models for the request timeout (30 s here,
    600 s by default): once, each D was asked in turn, each for the whole request timeout.
    Any role answers: here the P, since the only other D hangs."""
    client, _ = proxy_with({"d-hung": ("kv_consumer", "hang"), "p-ok": ("kv_producer", "ok")})
    t0 = time.monotonic()
    r = client.get("/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "model-of-p-ok"
    assert time.monotonic() - t0 < 5


def test_models_is_a_503_when_no_instance_replies(proxy_with):
    client, _ = proxy_with({"p-hung": ("kv_producer", "hang"), "d-hung": ("kv_consumer", "hang")})
    t0 = time.monotonic()
    r = client.get("/v1/models")
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert "no instance answered /v1/models (each given 1 s)" in error["message"]
    assert error["type"] == "ServiceUnavailableError"
    assert time.monotonic() - t0 < 5  # the connect timeout (1 s), not the request timeout
