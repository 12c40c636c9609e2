"""BodySizeLimitMiddleware: requests with bodies over a limit get 413 before any parsing."""

from __future__ import annotations

from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.entrypoints.openai.cli_args import DEFAULT_MAX_BODY_BYTES
from pagedkv.entrypoints.openai.errors import OpenAIError


class BodySizeLimitMiddleware:
    """Reads the whole body first (declared length or not, so chunked uploads are capped too),
    then hands the app a ``receive`` that replays it and afterwards passes through (so the app
    still hears ``http.disconnect``)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body: list[Message] = [{"type": "http.request", "body": b"".join(chunks)}]

        async def replay() -> Message:
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = OpenAIError(
            f"request body larger than {self.max_bytes} bytes",
            status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        )
        await error.to_json_response()(scope, receive, send)
