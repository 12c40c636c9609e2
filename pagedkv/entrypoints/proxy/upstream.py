"""One upstream call of the proxy: P's prefill, D's answer opened, D's stream relayed.

Every call has a connect timeout and a read timeout (``ProxyConfig``), counts as in flight at
its instance while it runs (``Router.acquire``/``release``, exactly once on every path), and
fails with an ``UpstreamError`` that says what the request loop may do about it. D's answer
counts as failed to load its KV when it is a 502, or a stream whose first SSE event is an
error, of type ``KVTransferError``: nothing reached the client, so it may be retried.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from http import HTTPStatus

import httpx
from fastapi import Response
from fastapi.responses import StreamingResponse

from pagedkv.entrypoints.openai.errors import KV_TRANSFER_ERROR, OpenAIError
from pagedkv.entrypoints.proxy.cli_args import FALLBACKS
from pagedkv.entrypoints.proxy.registry import Instance
from pagedkv.entrypoints.proxy.router import Router

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
    #: "none", or "local": when P or the KV transfer fails, D prefills the request itself.
    fallback: str = "none"

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")


#: What ``relay`` keeps of a stream's end for ``on_answer`` (its usage chunk is there).
_TAIL_BYTES = 4096
#: Connection errors that mean "closed before any answer": retried on a fresh connection.
_CLOSED_EARLY = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class UpstreamError(Exception):
    """One attempt failed at ``instance``. ``client_error``: a 4xx to hand to the client as is
    (no retry); ``unreachable``: the connection was refused (drop the instance); ``closed``:
    the connection closed before any answer (retry, on a fresh connection); ``kv_load``: D
    could not load the KV from P (P is to blame)."""

    def __init__(
        self,
        instance: Instance,
        reason: str,
        client_error: Response | None = None,
        unreachable: bool = False,
        closed: bool = False,
        kv_load: bool = False,
    ) -> None:
        super().__init__(f"{instance.engine_id} ({instance.info.http_url}): {reason}")
        self.instance = instance
        self.client_error = client_error
        self.unreachable = unreachable
        self.closed = closed
        self.kv_load = kv_load

    @classmethod
    def from_http_error(cls, instance: Instance, what: str, e: httpx.HTTPError) -> UpstreamError:
        return cls(
            instance,
            f"{what}: {type(e).__name__}: {e}",
            unreachable=isinstance(e, httpx.ConnectError),
            closed=isinstance(e, _CLOSED_EARLY),
        )


def kv_transfer_error(body: bytes) -> str | None:
    """The message of an OpenAI error body (or first SSE event) of type KVTransferError."""
    text = body.removeprefix(b"data: ").split(b"\n\n", 1)[0]
    try:
        error = json.loads(text)["error"]
        if error["type"] == KV_TRANSFER_ERROR:
            return str(error["message"])
    except (ValueError, KeyError, TypeError):
        pass
    return None


@dataclass
class Opened:
    """D's answer once its first bytes are in: ``first`` (or the whole body, ``chunks`` None)."""

    response: httpx.Response
    first: bytes
    chunks: AsyncIterator[bytes] | None


def sse_error(message: str, status: HTTPStatus = HTTPStatus.BAD_GATEWAY) -> bytes:
    error = OpenAIError(message, status=status).to_response().model_dump()
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


class Upstream:
    """The proxy's HTTP calls to its instances (one shared connection pool)."""

    def __init__(self, router: Router, config: ProxyConfig) -> None:
        self.router = router
        self.config = config
        self.client: httpx.AsyncClient | None = None

    @property
    def _timeout(self) -> httpx.Timeout:
        c = self.config
        return httpx.Timeout(c.request_timeout_s, connect=c.connect_timeout_s)

    def headers(self, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        if self.config.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.config.upstream_api_key}"
        return headers

    async def prefill(self, p: Instance, path: str, body: dict, transfer_id: str) -> None:
        assert self.client is not None
        self.router.acquire(p)
        try:
            response = await self.client.post(
                p.info.http_url + path,
                json=body,
                headers=self.headers(transfer_id),
                timeout=self._timeout,
            )
        except httpx.HTTPError as e:
            raise UpstreamError.from_http_error(p, "prefill", e) from None
        finally:
            self.router.release(p)
        if response.status_code >= 500:
            raise UpstreamError(p, f"prefill: HTTP {response.status_code}")
        if response.status_code != 200:
            media_type = response.headers.get("content-type")
            client_error = Response(response.content, response.status_code, media_type=media_type)
            raise UpstreamError(p, f"prefill: HTTP {response.status_code}", client_error)

    async def open_decode(
        self, d: Instance, path: str, body: dict, headers: dict, stream: bool
    ) -> Opened:
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
                message = kv_transfer_error(await response.aread())
                if message is not None:
                    raise UpstreamError(d, f"decode: KV load failed: {message}", kv_load=True)
                raise UpstreamError(d, f"decode: HTTP {response.status_code}")
            if not stream or response.status_code != 200:
                return Opened(response, await response.aread(), None)
            chunks = response.aiter_raw()
            first = await anext(chunks, b"")
            if not first:
                raise UpstreamError(d, "decode: empty stream")
            if (message := kv_transfer_error(first)) is not None:
                raise UpstreamError(d, f"decode: KV load failed: {message}", kv_load=True)
            return Opened(response, first, chunks)
        except BaseException as e:
            if response is not None:
                await response.aclose()
            self.router.release(d)
            if isinstance(e, httpx.HTTPError):
                raise UpstreamError.from_http_error(d, "decode", e) from None
            raise

    def relay(
        self,
        d: Instance,
        opened: Opened,
        abort_reason: Callable[[], str | None],
        headers: dict[str, str] | None = None,
        on_answer: Callable[[bytes], None] | None = None,
    ) -> Response:
        """D's answer to the client, with ``headers``; a stream ends early with an error event
        once ``abort_reason()`` says why (the proxy is shutting down). ``on_answer`` is given a
        complete answer's body (of a stream: its last ``_TAIL_BYTES``, where usage is)."""
        response = opened.response
        media_type = response.headers.get("content-type")
        ok = response.status_code == 200
        if opened.chunks is None:
            self.router.release(d)
            if on_answer is not None and ok:
                on_answer(opened.first)
            return Response(opened.first, response.status_code, headers, media_type=media_type)

        async def relay() -> AsyncIterator[bytes]:
            tail = b""
            try:
                yield opened.first
                tail = opened.first[-_TAIL_BYTES:]
                async for chunk in opened.chunks:  # type: ignore[union-attr]
                    if (reason := abort_reason()) is not None:
                        yield sse_error(reason, HTTPStatus.SERVICE_UNAVAILABLE)
                        return
                    yield chunk
                    tail = (tail + chunk)[-_TAIL_BYTES:]
                if on_answer is not None and ok:
                    on_answer(tail)
            except httpx.HTTPError as e:
                logger.warning("decode %s failed mid-stream: %s", d.engine_id, e)
                yield sse_error(f"the decode instance failed mid-stream: {type(e).__name__}")
            finally:
                await response.aclose()
                self.router.release(d)

        return StreamingResponse(
            relay(), status_code=response.status_code, headers=headers, media_type=media_type
        )
