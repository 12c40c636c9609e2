"""``pagedkv proxy``: an OpenAI-compatible front end that splits each request between a P and a D.

Per request (concurrent dispatch: no extra round trip before D starts)::

    transfer_id = a fresh uuid (the proxy's own: never derived from request ids)
    P  <- the request, max_tokens=1, stream=false, kv_transfer_params={do_remote_decode,
          transfer_id, remote_engine_id/host/port = D's KV address}    (its answer is dropped)
    D  <- the request as sent,   kv_transfer_params={do_remote_prefill, transfer_id,
          remote_engine_id/host/port = P's KV address}                 (its answer is relayed)

Request ids. D gets the client's ``X-Request-Id`` (so the answer's id is the one the client
chose, as from a single instance), suffixed ``-retry<n>`` on a retry so it never meets the
aborted first attempt's id on the same D; without one, and for P, the transfer id.

Failures. Every upstream call has a connect timeout and a read timeout. Until the first byte
of D's answer reaches the client, a failed P or D (connection error, 5xx, timeout) costs only
a retry on another pair with a fresh transfer id (the other half is cancelled, so its engine
aborts and frees); an instance that refused the connection is dropped from the registry until
its next heartbeat. After that first byte, a failure ends the stream with an error event. No
live pair, or every attempt failed: 503. A 4xx from either side is the client's error and is
returned as is (the other half is cancelled). An attempt cancelled midway cancels both halves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.entrypoints import KEEP_ALIVE_S
from pagedkv.entrypoints.openai.body_size_limit import BodySizeLimitMiddleware
from pagedkv.entrypoints.openai.errors import OpenAIError
from pagedkv.entrypoints.proxy.registry import Instance, InstanceRegistry
from pagedkv.entrypoints.proxy.router import Router
from pagedkv.kv_transfer.p2p.config import SECRET_ENV

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProxyConfig:
    #: Clients must send ``Authorization: Bearer <api_key>`` (None: open).
    api_key: str | None = None
    #: What the proxy sends upstream to the instances.
    upstream_api_key: str | None = None
    connect_timeout_s: float = 5.0
    #: Longest wait for any upstream byte (P's answer, each chunk of D's).
    request_timeout_s: float = 600.0
    max_attempts: int = 3


class UpstreamError(Exception):
    """One attempt failed at ``instance``. ``client_error``: a 4xx to hand to the client as is
    (no retry); ``unreachable``: the connection itself failed (drop the instance)."""

    def __init__(
        self,
        instance: Instance,
        reason: str,
        client_error: Response | None = None,
        unreachable: bool = False,
    ) -> None:
        super().__init__(f"{instance.engine_id} ({instance.info.http_url}): {reason}")
        self.instance = instance
        self.client_error = client_error
        self.unreachable = unreachable


@dataclass
class _Opened:
    """D's answer once its first bytes are in: ``first`` (or the whole body, ``chunks`` None)."""

    response: httpx.Response
    first: bytes
    chunks: AsyncIterator[bytes] | None


def _sse_error(message: str) -> bytes:
    error = OpenAIError(message, status=HTTPStatus.BAD_GATEWAY).to_response().model_dump()
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


class PDProxy:
    def __init__(self, registry: InstanceRegistry, router: Router, config: ProxyConfig) -> None:
        self.registry = registry
        self.router = router
        self.config = config
        self.client: httpx.AsyncClient | None = None

    @property
    def _timeout(self) -> httpx.Timeout:
        c = self.config
        return httpx.Timeout(c.request_timeout_s, connect=c.connect_timeout_s)

    def _headers(self, transfer_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": transfer_id}
        if self.config.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.config.upstream_api_key}"
        return headers

    # ------------------------------------------------------------------ one client request
    async def handle(self, raw_request: Request, path: str) -> Response:
        try:
            body = await raw_request.json()
        except RecursionError:
            raise OpenAIError("request body is not valid JSON: nested too deeply") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise OpenAIError(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise OpenAIError("request body must be a JSON object")
        try:  # Python's json reads NaN and Infinity, but they cannot be sent on to P and D
            json.dumps(body, allow_nan=False)
        except ValueError:
            raise OpenAIError(
                "request body is not valid JSON: NaN and Infinity are not JSON numbers"
            ) from None
        stream = bool(body.get("stream"))
        client_id = raw_request.headers.get("X-Request-Id")
        failed: set[str] = set()
        reasons: list[str] = []
        for attempt in range(self.config.max_attempts):
            pair = self.router.pick_pair(failed)
            if pair is None:
                break
            decode_id = client_id if attempt == 0 else f"{client_id}-retry{attempt}"
            try:
                return await self._attempt(path, body, *pair, stream, client_id and decode_id)
            except UpstreamError as e:
                if e.client_error is not None:
                    return e.client_error
                logger.warning("attempt failed, retrying elsewhere: %s", e)
                reasons.append(str(e))
                failed.add(e.instance.engine_id)
                if e.unreachable:
                    self.registry.evict(e.instance.engine_id, str(e))
        message = "no prefill/decode instance pair is available"
        if reasons:
            message = f"{message}: every attempt failed ({'; '.join(reasons)})"
        raise OpenAIError(message, status=HTTPStatus.SERVICE_UNAVAILABLE)

    async def _attempt(
        self, path: str, body: dict, p: Instance, d: Instance, stream: bool, decode_id: str | None
    ) -> Response:
        transfer_id = uuid.uuid4().hex
        headers = self._headers(transfer_id)
        decode_headers = self._headers(decode_id or transfer_id)
        prefill_body = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "transfer_id": transfer_id,
                "remote_engine_id": d.engine_id,
                "remote_host": d.kv.host,
                "remote_port": d.kv.port,
            },
        }
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in body:
            prefill_body["max_completion_tokens"] = 1
        decode_body = {
            **body,
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "transfer_id": transfer_id,
                "remote_engine_id": p.engine_id,
                "remote_host": p.kv.host,
                "remote_port": p.kv.port,
            },
        }
        p_task = asyncio.create_task(self._prefill(p, path, prefill_body, headers))
        d_task = asyncio.create_task(
            self._open_decode(d, path, decode_body, decode_headers, stream)
        )
        try:
            await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if not d_task.done() and p_task.exception() is not None:
                # D would wait for KV that never comes: stop it, retry elsewhere
                raise p_task.exception()  # type: ignore[misc]
            opened = await d_task
        except BaseException:  # a failure, or cancelled (the client is gone)
            await self._abandon(d, p_task, d_task)
            raise
        if opened.response.status_code != 200:
            p_task.cancel()  # D refused the request: nobody will pull P's KV
        p_task.add_done_callback(_log_late_prefill_failure)
        return self._relay(d, opened)

    async def _abandon(self, d: Instance, p_task: asyncio.Task, d_task: asyncio.Task) -> None:
        """Cancel both halves (P and D see their connection closed: each aborts and frees).
        A D answer already opened (done just as we were cancelled) is closed here."""
        p_task.cancel()
        d_task.cancel()
        await asyncio.gather(p_task, d_task, return_exceptions=True)
        if not d_task.cancelled() and d_task.exception() is None:
            await d_task.result().response.aclose()
            self.router.release(d)

    async def _prefill(self, p: Instance, path: str, body: dict, headers: dict) -> None:
        assert self.client is not None
        self.router.acquire(p)
        try:
            response = await self.client.post(
                p.info.http_url + path, json=body, headers=headers, timeout=self._timeout
            )
        except httpx.HTTPError as e:
            reason = f"prefill: {type(e).__name__}: {e}"
            unreachable = isinstance(e, httpx.ConnectError)
            raise UpstreamError(p, reason, unreachable=unreachable) from None
        finally:
            self.router.release(p)
        if response.status_code >= 500:
            raise UpstreamError(p, f"prefill: HTTP {response.status_code}")
        if response.status_code != 200:
            raise UpstreamError(
                p,
                f"prefill: HTTP {response.status_code}",
                client_error=Response(
                    response.content,
                    response.status_code,
                    media_type=response.headers.get("content-type"),
                ),
            )

    async def _open_decode(
        self, d: Instance, path: str, body: dict, headers: dict, stream: bool
    ) -> _Opened:
        """D's response with its first bytes read (its TTFT), or its whole body if not
        streaming. Raises UpstreamError; cancelled, it closes the connection (D aborts)."""
        assert self.client is not None
        response = None
        self.router.acquire(d)
        try:  # released on every path out, the request's own encoding failing included
            request = self.client.build_request(
                "POST", d.info.http_url + path, json=body, headers=headers, timeout=self._timeout
            )
            response = await self.client.send(request, stream=True)
            if response.status_code >= 500:
                raise UpstreamError(d, f"decode: HTTP {response.status_code}")
            if not stream or response.status_code != 200:
                return _Opened(response, await response.aread(), None)
            chunks = response.aiter_raw()
            first = await anext(chunks, b"")
            if not first:
                raise UpstreamError(d, "decode: empty stream")
            return _Opened(response, first, chunks)
        except httpx.HTTPError as e:
            if response is not None:
                await response.aclose()
            self.router.release(d)
            reason = f"decode: {type(e).__name__}: {e}"
            unreachable = isinstance(e, httpx.ConnectError)
            raise UpstreamError(d, reason, unreachable=unreachable) from None
        except BaseException:
            if response is not None:
                await response.aclose()
            self.router.release(d)
            raise

    def _relay(self, d: Instance, opened: _Opened) -> Response:
        response = opened.response
        media_type = response.headers.get("content-type")
        if opened.chunks is None:
            self.router.release(d)
            return Response(opened.first, response.status_code, media_type=media_type)

        async def relay() -> AsyncIterator[bytes]:
            try:
                yield opened.first
                async for chunk in opened.chunks:  # type: ignore[union-attr]
                    yield chunk
            except httpx.HTTPError as e:
                logger.warning("decode %s failed mid-stream: %s", d.engine_id, e)
                yield _sse_error(f"the decode instance failed mid-stream: {type(e).__name__}")
            finally:
                await response.aclose()
                self.router.release(d)

        return StreamingResponse(relay(), status_code=response.status_code, media_type=media_type)

    async def models(self) -> Response:
        """The first decode instance's answer. All are asked at once, each for at most the
        connect timeout: a hung D must not hold up the endpoint for the request timeout."""
        client = self.client
        assert client is not None
        timeout = self.config.connect_timeout_s

        async def ask(d: Instance) -> Response | None:
            url = d.info.http_url + "/v1/models"
            try:
                r = await client.get(url, headers=self._headers(uuid.uuid4().hex), timeout=timeout)
            except httpx.HTTPError as e:
                logger.warning("decode %s: /v1/models: %s: %s", d.engine_id, type(e).__name__, e)
                return None
            if r.status_code != 200:
                return None
            return Response(r.content, 200, media_type="application/json")

        decoders = [i for i in self.registry.live() if i.is_decode]
        asks = [asyncio.create_task(ask(d)) for d in decoders]
        try:
            for answered in asyncio.as_completed(asks):
                if (answer := await answered) is not None:
                    return answer
        finally:
            for task in asks:
                task.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
        message = "no decode instance is available"
        if decoders:
            message = f"no decode instance answered /v1/models (each given {timeout:g} s)"
        raise OpenAIError(message, status=HTTPStatus.SERVICE_UNAVAILABLE)


def _log_late_prefill_failure(task: asyncio.Task) -> None:
    """P failed after D had already answered: D had its KV (or recomputed); just log."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning("prefill failed after decode answered: %s", task.exception())


def build_proxy_app(registry: InstanceRegistry, router: Router, config: ProxyConfig) -> FastAPI:
    proxy = PDProxy(registry, router, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        registry.start()
        proxy.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None))
        try:
            yield
        finally:
            await proxy.client.aclose()
            registry.close()

    async def check_api_key(request: Request) -> None:
        if config.api_key is None:
            return
        expected = f"Bearer {config.api_key}".encode()
        given = request.headers.get("Authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            raise OpenAIError(
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                status=HTTPStatus.UNAUTHORIZED,
            )

    api = APIRouter(dependencies=[Depends(check_api_key)])

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @api.get("/v1/models")
    async def models() -> Response:
        return await proxy.models()

    @api.get("/instances")
    async def instances() -> JSONResponse:
        live = registry.live()
        return JSONResponse(
            {
                "prefill": [i.describe() for i in live if i.is_prefill],
                "decode": [i.describe() for i in live if i.is_decode],
                "in_flight": dict(router.in_flight),
            }
        )

    app = FastAPI(title="pagedkv proxy", lifespan=lifespan)
    app.include_router(api)

    @app.get("/health")
    async def health() -> JSONResponse:
        live = registry.live()
        return JSONResponse(
            {
                "prefill": sum(i.is_prefill for i in live),
                "decode": sum(i.is_decode for i in live),
            }
        )

    @app.exception_handler(OpenAIError)
    async def on_openai_error(_: Request, exc: OpenAIError) -> Response:
        return exc.to_json_response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return OpenAIError(str(exc.detail), status=HTTPStatus(exc.status_code)).to_json_response()

    app.add_middleware(BodySizeLimitMiddleware)
    return app


def run_proxy(args) -> None:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    secret = os.environ.get(SECRET_ENV)
    registry = InstanceRegistry(
        args.registry_host,
        args.registry_port,
        secret.encode() if secret else None,
        args.instance_timeout,
    )
    config = ProxyConfig(
        api_key=args.api_key,
        upstream_api_key=args.upstream_api_key,
        connect_timeout_s=args.connect_timeout,
        request_timeout_s=args.request_timeout,
        max_attempts=args.max_attempts,
    )
    app = build_proxy_app(registry, Router(registry, args.routing), config)
    logger.info(
        "proxy on http://%s:%d, registry tcp://%s:%d (%s)",
        args.host,
        args.port,
        args.registry_host,
        args.registry_port,
        args.routing,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
