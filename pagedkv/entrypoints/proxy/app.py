"""``pagedkv proxy``: the OpenAI-compatible front end of replicas and P/D pairs (``PDProxy``
does the routing and retrying; ``/v1/models`` and ``/v1/models/{id}`` are any instance's
answer), its ``/instances``, ``/health``, ``/version`` and ``/metrics``, and the process that
runs it (drained on SIGTERM). Under ``kv_aware`` routing it follows every instance's KV events
(``KVEventSubscriber``) into the ``KVIndex`` the router reads."""

from __future__ import annotations

import contextlib
import logging
import os
from urllib.parse import quote

import httpx
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import pagedkv
from pagedkv.entrypoints.openai.body_size_limit import BodySizeLimitMiddleware
from pagedkv.entrypoints.openai.errors import (
    add_openai_error_handlers,
    api_key_check,
)
from pagedkv.entrypoints.openai.protocol import VersionResponse
from pagedkv.entrypoints.proxy.kv_index import KVIndex
from pagedkv.entrypoints.proxy.metrics import ProxyMetrics
from pagedkv.entrypoints.proxy.pd_proxy import PDProxy
from pagedkv.entrypoints.proxy.prompt_blocks import PromptTokenizer
from pagedkv.entrypoints.proxy.registry import Instance, InstanceRegistry
from pagedkv.entrypoints.proxy.router import ROUTING_POLICIES, Router
from pagedkv.entrypoints.proxy.upstream import ProxyConfig
from pagedkv.entrypoints.serving.draining_server import DrainingServer
from pagedkv.kv_cache.kv_events import GPU
from pagedkv.kv_events.feed import FeedAddress
from pagedkv.kv_events.subscriber import KVEventSubscriber
from pagedkv.transport.codec import SECRET_ENV

logger = logging.getLogger(__name__)


def follow_kv_events(registry: InstanceRegistry, index: KVIndex) -> KVEventSubscriber:
    """A subscriber that follows each registered instance's KV events into ``index``: from
    scratch when it joins or comes back as a new process, dropped when it leaves."""
    subscriber = KVEventSubscriber(index)

    def joined(instance: Instance) -> None:
        info = instance.info
        index.set_num_groups(instance.engine_id, info.num_kv_cache_groups)
        if info.kv_events_endpoint:
            address = FeedAddress(
                info.kv_events_endpoint,
                info.kv_events_replay_endpoint or None,
                info.kv_events_topic,
            )
            subscriber.follow(instance.engine_id, address)
        else:
            subscriber.forget(instance.engine_id)

    registry.on_joined = joined
    registry.on_left = subscriber.forget
    return subscriber


def build_proxy_app(registry: InstanceRegistry, router: Router, config: ProxyConfig) -> FastAPI:
    """The proxy's app; its ``PDProxy`` is ``app.state.proxy``."""
    metrics = ProxyMetrics()
    proxy = PDProxy(registry, router, config, metrics)
    registry.pairing_note = router.pairing_note
    index = router.kv_index
    subscriber = follow_kv_events(registry, index) if index is not None else None
    if subscriber is not None:
        metrics.watch_index(index.cached_blocks_by_medium, lambda: dict(subscriber.stats))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if subscriber is not None:
            subscriber.start()
        registry.start()
        proxy.upstream.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None))
        try:
            yield
        finally:
            await proxy.upstream.client.aclose()
            registry.close()
            if subscriber is not None:
                subscriber.close()

    app = FastAPI(title="pagedkv proxy", lifespan=lifespan)
    app.include_router(_client_api(proxy, subscriber))
    app.include_router(_service_api(registry, metrics))

    add_openai_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware)
    app.state.proxy = proxy
    return app


def _client_api(proxy: PDProxy, subscriber: KVEventSubscriber | None) -> APIRouter:
    """What a client asks, behind ``--api-key``: the OpenAI endpoints and ``/instances``."""
    registry, router, api_key = proxy.registry, proxy.router, proxy.config.api_key

    api = APIRouter(dependencies=api_key_check(api_key))

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @api.get("/v1/models")
    async def models() -> Response:
        return await proxy.ask_any("/v1/models")

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return await proxy.ask_any(f"/v1/models/{quote(model_id, safe='')}")

    def describe(instance: Instance) -> dict:
        described = {**instance.describe(), "pairing": router.pairing_note(instance) or "ok"}
        if subscriber is not None:
            assert router.kv_index is not None
            feed = subscriber.stats.get(instance.engine_id)
            by_medium = router.kv_index.cached_blocks_by_medium(instance.engine_id)
            described["kv_index"] = {
                "cached_blocks": by_medium[GPU],
                "cached_blocks_by_medium": by_medium,
                **(feed.describe() if feed is not None else {"state": "no KV events"}),
            }
        return described

    @api.get("/instances")
    async def instances() -> JSONResponse:
        live = registry.live()
        return JSONResponse(
            {
                "replica": [describe(i) for i in live if i.is_replica],
                "prefill": [describe(i) for i in live if i.is_prefill],
                "decode": [describe(i) for i in live if i.is_decode],
                "refused": registry.refused(),
                "in_flight": dict(router.in_flight),
            }
        )

    return api


def _service_api(registry: InstanceRegistry, metrics: ProxyMetrics) -> APIRouter:
    """``/health`` (live instances by role), ``/version`` and ``/metrics``: open to all."""
    api = APIRouter()

    @api.get("/health")
    async def health() -> JSONResponse:
        live = registry.live()
        return JSONResponse(
            {
                "replica": sum(i.is_replica for i in live),
                "prefill": sum(i.is_prefill for i in live),
                "decode": sum(i.is_decode for i in live),
            }
        )

    @api.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=pagedkv.__version__)

    @api.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return api


def run_proxy(args) -> None:
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
        fallback=args.fallback,
    )
    tokenizer = None
    needs_kv_index = ROUTING_POLICIES[args.routing].needs_kv_index
    if needs_kv_index or args.disagg_threshold:
        tokenizer = PromptTokenizer(args.tokenizer)
    router = Router(
        registry,
        args.routing,
        kv_index=KVIndex() if needs_kv_index else None,
        tokenizer=tokenizer,
        load_weight=args.load_weight,
        tier_costs=args.kv_tier_cost,
        disagg_threshold=args.disagg_threshold,
    )
    app = build_proxy_app(registry, router, config)
    server = DrainingServer.for_app(app, args, abort_in_flight=app.state.proxy.abort_in_flight)
    logger.info(
        "proxy on http://%s:%d, registry tcp://%s:%d (%s)",
        args.host,
        args.port,
        args.registry_host,
        args.registry_port,
        args.routing,
    )
    server.run()
    logger.info("shut down")
