"""The OpenAI-compatible HTTP server: FastAPI app factory and the ``pagedkv serve`` runner.

    /v1/completions, /v1/chat/completions, /v1/models, /v1/models/{id}
                                                         (``--api-key``: Bearer token required)
    /health, /ping, /metrics, /version                   (open, as in vLLM)
    /tokenize, /detokenize                               (open, as in vLLM; vLLM's shapes)

Every error, including FastAPI's own (422 validation, 404 route), answers in OpenAI's format;
validation errors become 400 naming the field.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from http import HTTPStatus

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

import pagedkv
from pagedkv.engine.async_llm import AsyncLLM
from pagedkv.engine.engine_args import EngineArgs
from pagedkv.entrypoints.openai.body_size_limit import BodySizeLimitMiddleware
from pagedkv.entrypoints.openai.cli_args import DEFAULT_MAX_BODY_BYTES
from pagedkv.entrypoints.openai.errors import (
    OpenAIError,
    add_openai_error_handlers,
    api_key_check,
    model_not_found,
)
from pagedkv.entrypoints.openai.metrics import KVTransferCollector, PrometheusStatLogger
from pagedkv.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from pagedkv.entrypoints.openai.registration import (
    RegistrationConfig,
    registration_extra_config,
    start_registration,
)
from pagedkv.entrypoints.openai.registration_client import close_all
from pagedkv.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedkv.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedkv.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedkv.entrypoints.serving.draining_server import DrainingServer

logger = logging.getLogger(__name__)


def build_app(
    async_llm: AsyncLLM,
    served_model_name: str,
    registry: CollectorRegistry,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The app for one engine. ``registry`` holds its metrics (PrometheusStatLogger)."""
    app = FastAPI(title="pagedkv", description="OpenAI-compatible API over a pagedkv engine")
    app.include_router(_v1_routes(async_llm, served_model_name, api_key))
    tokenization = OpenAIServingTokenization(async_llm, served_model_name)

    @app.get("/health")
    async def health() -> Response:
        if not async_llm.is_running:
            raise OpenAIError("the engine is not running", status=HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=200)

    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=pagedkv.__version__)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return tokenization.detokenize(request)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    add_openai_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    return app


def _v1_routes(async_llm: AsyncLLM, served_model_name: str, api_key: str | None) -> APIRouter:
    """``/v1/models[/{id}]``, ``/v1/completions``, ``/v1/chat/completions``; with ``api_key``,
    each needs ``Authorization: Bearer <key>``."""
    completions = OpenAIServingCompletion(async_llm, served_model_name)
    chat = OpenAIServingChat(async_llm, served_model_name)

    v1 = APIRouter(prefix="/v1", dependencies=api_key_check(api_key))
    card = ModelCard(
        id=served_model_name,
        root=str(async_llm.llm_engine.description.model_path),
        max_model_len=async_llm.max_model_len,
    )

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[card])

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        if model_id != served_model_name:
            raise model_not_found(model_id, served_model_name)
        return card

    @v1.post("/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @v1.post("/chat/completions")
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    return v1


#: How long a server whose engine failed keeps answering (``/health``: 503) before it stops.
FAILED_GRACE_S = 1.0


def stop_when_failed(async_llm: AsyncLLM, server: DrainingServer) -> None:
    """Once the engine has failed (a tensor-parallel rank died, a step raised), stop the
    server: its requests have ended with an error, ``/health`` answers 503 for
    ``FAILED_GRACE_S``, then it exits non-zero (vLLM's server does the same)."""

    def watch() -> None:
        async_llm.failed.wait()
        time.sleep(FAILED_GRACE_S)
        logger.error("the engine failed: stopping the server")
        server.should_exit = True

    threading.Thread(target=watch, name="pagedkv-failed-engine", daemon=True).start()


def run_server(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine_args = EngineArgs.from_cli_args(args)
    extra = registration_extra_config(engine_args.kv_transfer_config)
    registration = RegistrationConfig.from_args(args.registry, extra)  # fails before loading
    served_model_name = args.served_model_name or engine_args.model_path.name
    registry = CollectorRegistry()
    async_llm = AsyncLLM(engine_args, [PrometheusStatLogger(registry, served_model_name)])
    engine = async_llm.llm_engine
    if engine.model_runner.kv_connector is not None:
        registry.register(KVTransferCollector(engine.get_kv_connector_stats, served_model_name))
    if engine.kv_event_publisher is not None:
        stats = engine.kv_event_publisher.get_stats
        registry.register(KVTransferCollector(stats, served_model_name, "kv_events"))
    registrations = start_registration(
        engine.description,
        engine.load,
        engine.kv_paths,
        registration,
        served_model_name,
        args.host,
        args.port,
    )
    app = build_app(
        async_llm,
        served_model_name,
        registry,
        api_key=args.api_key,
        max_body_bytes=args.max_request_body_bytes,
    )
    drain_began: float | None = None

    def begin_drain() -> None:
        """Leave the proxies' routing first: no new request is sent here from now on."""
        nonlocal drain_began
        drain_began = drain_began or time.monotonic()
        close_all(registrations)

    server = DrainingServer.for_app(app, args, begin_drain, async_llm.abort_all)
    stop_when_failed(async_llm, server)
    logger.info("serving %s on http://%s:%d", served_model_name, args.host, args.port)
    try:
        server.run()
    finally:
        begin_drain()  # idempotent: a server that failed to start deregisters too
        # What the engine still holds once the HTTP side is done (KV a decode instance is
        # still pulling from this one) gets what is left of the shutdown timeout.
        left = (drain_began or 0.0) + args.shutdown_timeout - time.monotonic()
        async_llm.shutdown(drain_s=max(left, 0.0))
        async_llm.llm_engine.shutdown()  # the KV connector: peers told, threads and sockets
        logger.info("shut down")
    if async_llm.failed.is_set():
        raise SystemExit("the engine failed: the server stopped (see the error above)")
