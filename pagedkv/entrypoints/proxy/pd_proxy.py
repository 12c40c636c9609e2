"""PDProxy: each client request sent to one instance, or split between a P and a D, retried
until it has an answer.

The router (``router.py``) names the instance that answers and, for a D, its P. A replica, or
a D that prefills the request itself (conditional disaggregation, ``--fallback local``), gets
the request as sent. A P/D pair, per request (concurrent dispatch: no extra round trip before
D starts)::

    transfer_id = a fresh uuid4 (the proxy's own: never derived from request ids; random, so
                  proxies serving the same instances never mint the same one)
    P  <- the request, max_tokens=1, stream=false, kv_transfer_params={do_remote_decode,
          transfer_id, remote_engine_id/host/port = D's KV address}    (its answer is dropped)
    D  <- the request as sent,   kv_transfer_params={do_remote_prefill, transfer_id,
          remote_engine_id/host/port = P's KV address}                 (its answer is relayed)

Request ids. D gets the client's ``X-Request-Id`` (so the answer's id is the one the client
chose, as from a single instance), suffixed ``-retry<n>`` on a retry so it never meets the
aborted first attempt's id on the same D; without one, and for P, the transfer id.

Failures. Every upstream call has a connect timeout and a read timeout. Until the first byte
of D's answer reaches the client, a failed P or D costs only a retry with a fresh transfer id
(the other half is cancelled, so its engine aborts and frees):

    connection closed before any answer (a stale keep-alive connection, an instance draining)
        -> the same instances may be tried again, on a fresh connection (once each)
    connection refused, 5xx, timeout      -> that instance is skipped for this request
    D could not load the KV from P (a 502 or first SSE event of type KVTransferError)
        -> P is skipped; with ``--fallback local`` the next attempt sends the request to a D
           alone, which prefills it itself (so does a request with no pair left but a D)

An instance that refused the connection is dropped from the registry until its next heartbeat.
After the first byte, a failure ends the stream with an error event. Nobody left to answer, or
every attempt failed: a 503 naming each failed attempt, then each registered instance not
used, with why (no peer of its model and KV layout, each such peer failed). The answer
carries ``x-pagedkv-instance`` (who answered), ``x-pagedkv-prefill-instance`` (its P, if any)
and, under ``kv_aware`` routing, ``x-pagedkv-predicted-hit-tokens`` (the prompt tokens the
index said it had cached). A 4xx from either side is the client's error and is returned as is
(the other half is cancelled). An attempt cancelled midway cancels both halves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from http import HTTPStatus

import httpx
from fastapi import Request, Response

from pagedkv.entrypoints.openai.errors import OpenAIError
from pagedkv.entrypoints.proxy.metrics import ProxyMetrics, cached_tokens
from pagedkv.entrypoints.proxy.registry import Instance, InstanceRegistry
from pagedkv.entrypoints.proxy.router import Route, Router
from pagedkv.entrypoints.proxy.upstream import Opened, ProxyConfig, Upstream, UpstreamError
from pagedkv.kv_connector.params import KVTransferParams

logger = logging.getLogger(__name__)


class PDProxy:
    def __init__(
        self,
        registry: InstanceRegistry,
        router: Router,
        config: ProxyConfig,
        metrics: ProxyMetrics | None = None,
    ) -> None:
        self.registry = registry
        self.router = router
        self.config = config
        self.metrics = metrics or ProxyMetrics()
        self.upstream = Upstream(router, config)
        #: Set when a shutting-down proxy gives up on what is still in flight (with why).
        self.abort_reason: str | None = None
        self._aborted = asyncio.Event()

    def abort_in_flight(self, reason: str) -> None:
        """End every request in flight with an error: answers not begun get a 503, streams an
        error event (at their next chunk). Called on the event loop."""
        self.abort_reason = reason
        self._aborted.set()

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
        prompt = self.router.read_prompt(path, body)
        if prompt is not None:
            self.metrics.prompt_tokens.inc(len(prompt.token_ids))
        failed: set[str] = set()
        closed_once: set[str] = set()
        reasons: list[str] = []
        local = False
        for attempt in range(self.config.max_attempts):
            route = self.router.route(prompt, failed, alone=local)
            if route is None and self.config.fallback == "local" and not local:
                route, local = self.router.route(prompt, failed, alone=True), True
            if route is None:
                break
            decode_id = client_id if attempt == 0 else f"{client_id}-retry{attempt}"
            try:
                return await self._attempt(
                    path, body, route.p, route.d, stream, client_id and decode_id, route
                )
            except UpstreamError as e:
                if e.client_error is not None:
                    return e.client_error
                logger.warning("attempt %d failed, retrying: %s", attempt + 1, e)
                reasons.append(str(e))
                blamed = route.p if e.kv_load and route.p is not None else e.instance
                if e.closed and blamed.engine_id not in closed_once:
                    closed_once.add(blamed.engine_id)  # once more, on a fresh connection
                else:
                    failed.add(blamed.engine_id)
                if e.unreachable:
                    self.registry.evict(e.instance.engine_id, str(e))
                local = self.config.fallback == "local" and blamed is route.p
        pd = any(i.is_decode for i in self.registry.live())
        message = "no prefill/decode instance pair" if pd else "no instance"
        failures = f": every attempt failed ({'; '.join(reasons)});" if reasons else ":"
        message = f"{message} is available{failures} {self.router.why_no_pair(failed)}"
        raise OpenAIError(message, status=HTTPStatus.SERVICE_UNAVAILABLE)

    async def _attempt(
        self,
        path: str,
        body: dict,
        p: Instance | None,
        d: Instance,
        stream: bool,
        decode_id: str | None,
        route: Route | None = None,
    ) -> Response:
        """One try: P and D concurrently, or (``p`` None) D alone."""
        transfer_id = uuid.uuid4().hex
        decode_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        p_task = None
        if p is not None:
            p_task = asyncio.create_task(
                self.upstream.prefill(
                    p, path, self._prefill_body(body, d, transfer_id), transfer_id
                )
            )
            decode_body["kv_transfer_params"] = KVTransferParams.handoff(
                transfer_id, p.kv, to="decode", remote_tp_size=p.info.tensor_parallel_size
            ).to_dict()
        d_task = asyncio.create_task(
            self.upstream.open_decode(
                d, path, decode_body, self.upstream.headers(decode_id or transfer_id), stream
            )
        )
        aborted = asyncio.create_task(self._aborted.wait())
        try:
            if p_task is not None:
                await asyncio.wait({p_task, d_task, aborted}, return_when=asyncio.FIRST_COMPLETED)
                if not d_task.done() and p_task.done() and p_task.exception() is not None:
                    # D would wait for KV that never comes: stop it, retry elsewhere
                    raise p_task.exception()  # type: ignore[misc]
            await asyncio.wait({d_task, aborted}, return_when=asyncio.FIRST_COMPLETED)
            if not d_task.done():
                raise OpenAIError(
                    self.abort_reason or "the proxy is shutting down",
                    status=HTTPStatus.SERVICE_UNAVAILABLE,
                )
            opened = d_task.result()
        except BaseException:  # a failure, or cancelled (the client is gone)
            await self._abandon(d, p_task, d_task)
            raise
        finally:
            aborted.cancel()
        if p_task is not None:
            if opened.response.status_code != 200:
                p_task.cancel()  # D refused the request: nobody will pull P's KV
            p_task.add_done_callback(_log_late_prefill_failure)
        return self._relay(p, d, opened, None if route is None else route.predicted_hit_tokens)

    def _relay(
        self, p: Instance | None, d: Instance, opened: Opened, predicted: int | None
    ) -> Response:
        """D's answer for the client, with who answered (and the hit the router
        predicted: compared with the one D reports, when D computed the prompt itself)."""
        self.metrics.requests.labels("whole" if p is None else "disaggregated").inc()
        headers = {"x-pagedkv-instance": d.engine_id}
        if p is not None:
            headers["x-pagedkv-prefill-instance"] = p.engine_id
        on_answer = None
        if predicted is not None:
            headers["x-pagedkv-predicted-hit-tokens"] = str(predicted)
            if p is None:

                def on_answer(body: bytes) -> None:
                    realized = cached_tokens(body)
                    if realized is not None:
                        self.metrics.observe_hit(predicted, realized)

        return self.upstream.relay(d, opened, lambda: self.abort_reason, headers, on_answer)

    @staticmethod
    def _prefill_body(body: dict, d: Instance, transfer_id: str) -> dict:
        """P's request: one token, not streamed, its KV held for ``d``."""
        prefill_body = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": KVTransferParams.handoff(
                transfer_id, d.kv, to="prefill", remote_tp_size=d.info.tensor_parallel_size
            ).to_dict(),
        }
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in body:
            prefill_body["max_completion_tokens"] = 1
        return prefill_body

    async def _abandon(
        self, d: Instance, p_task: asyncio.Task | None, d_task: asyncio.Task
    ) -> None:
        """Cancel both halves (P and D see their connection closed: each aborts and frees).
        A D answer already opened (done just as we were cancelled) is closed here."""
        tasks = [d_task] if p_task is None else [p_task, d_task]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not d_task.cancelled() and d_task.exception() is None:
            await d_task.result().response.aclose()
            self.router.release(d)

    async def ask_any(self, path: str) -> Response:
        """``GET path`` (``/v1/models``, ``/v1/models/{id}``) of any live instance, of any role:
        the first 200, else the first other non-5xx answer (a 404 for a model it does not
        serve). All are asked at once, each for at most the connect timeout: a hung instance
        must not hold up the endpoint for the request timeout."""
        client = self.upstream.client
        assert client is not None
        timeout = self.config.connect_timeout_s

        async def ask(instance: Instance) -> httpx.Response | None:
            url = instance.info.http_url + path
            headers = self.upstream.headers(uuid.uuid4().hex)
            try:
                return await client.get(url, headers=headers, timeout=timeout)
            except httpx.HTTPError as e:
                logger.warning("%s: %s: %s: %s", instance.engine_id, path, type(e).__name__, e)
                return None

        instances = self.registry.live()
        asks = [asyncio.create_task(ask(i)) for i in instances]
        refusal: httpx.Response | None = None
        try:
            for answered in asyncio.as_completed(asks):
                answer = await answered
                if answer is None or answer.status_code >= 500:
                    continue
                if answer.status_code == 200:
                    return Response(answer.content, 200, media_type="application/json")
                refusal = refusal or answer
        finally:
            for task in asks:
                task.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
        if refusal is not None:
            media_type = refusal.headers.get("content-type")
            return Response(refusal.content, refusal.status_code, media_type=media_type)
        message = "no instance is registered"
        if instances:
            message = f"no instance answered {path} (each given {timeout:g} s)"
        raise OpenAIError(message, status=HTTPStatus.SERVICE_UNAVAILABLE)


def _log_late_prefill_failure(task: asyncio.Task) -> None:
    """P failed after D had already answered: D had its KV (or recomputed); just log."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning("prefill failed after decode answered: %s", task.exception())
