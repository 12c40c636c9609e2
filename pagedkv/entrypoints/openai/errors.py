"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import secrets
from http import HTTPStatus

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.BAD_GATEWAY: "BadGatewayError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}
#: The error type of a request whose KV could not be loaded from another instance (a 502, or
#: an SSE error event): a proxy may retry it elsewhere, since no token was produced.
KV_TRANSFER_ERROR = "KVTransferError"


class OpenAIError(Exception):
    """Raised by request handlers; the app turns it into an error response."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        error_type: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.error_type = error_type or _ERROR_TYPES.get(status, "InternalServerError")
        #: OpenAI's error code where it has one (``model_not_found``); else the status.
        self.code = code

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message,
                type=self.error_type,
                param=self.param,
                code=self.code or int(self.status),
            )
        )

    def to_json_response(self) -> JSONResponse:
        return JSONResponse(self.to_response().model_dump(), status_code=int(self.status))


def model_not_found(model: str, served_model_name: str) -> OpenAIError:
    """An unknown model: a 404 ``model_not_found``, as OpenAI and vLLM answer."""
    return OpenAIError(
        f"The model `{model}` does not exist (this server serves `{served_model_name}`).",
        param="model",
        status=HTTPStatus.NOT_FOUND,
        code="model_not_found",
    )


def bad_request_from(error: ValueError, param_names: dict[str, str]) -> OpenAIError:
    """A 400 for an engine ValueError.

    The engine's validation messages start with the offending field (``"temperature must be
    >= 0, got -1"``, ``"prompt has 300 tokens, ..."``); ``param_names`` maps such engine field
    names to the request's own (``max_tokens`` -> ``max_completion_tokens``).
    """
    message = str(error)
    first_word = message.split(" ", 1)[0]
    return OpenAIError(message, param=param_names.get(first_word))


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI's 422 as a 400: the first problem, and the top-level body field it is in."""
    error = exc.errors()[0]
    loc = [part for part in error.get("loc", ()) if part != "body"]
    if error.get("type") == "json_invalid":
        detail = error.get("ctx", {}).get("error", error.get("msg"))
        return OpenAIError(f"request body is not valid JSON: {detail}")
    param = loc[0] if loc and isinstance(loc[0], str) else None
    where = ".".join(str(part) for part in loc)
    return OpenAIError(f"{where}: {error.get('msg')}" if where else error.get("msg"), param)


def add_openai_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's format: ours, FastAPI's validation errors (a 400 naming the
    field) and Starlette's own (404 route, 405 method)."""

    @app.exception_handler(OpenAIError)
    async def on_openai_error(_: Request, exc: OpenAIError) -> Response:
        return exc.to_json_response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc).to_json_response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return OpenAIError(str(exc.detail), status=HTTPStatus(exc.status_code)).to_json_response()


def api_key_check(api_key: str | None) -> list:
    """Route dependencies that refuse a request without ``Authorization: Bearer <api_key>``
    (a 401; none without a key)."""
    if not api_key:
        return []

    async def check_api_key(request: Request) -> None:
        given = request.headers.get("Authorization", "").encode()
        if not secrets.compare_digest(given, f"Bearer {api_key}".encode()):
            raise OpenAIError(
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                status=HTTPStatus.UNAUTHORIZED,
            )

    return [Depends(check_api_key)]
