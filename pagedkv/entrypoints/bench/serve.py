"""``pagedkv bench serve``: a streaming load generator against an OpenAI-compatible server.

Requests go to ``/v1/completions`` as token ids (exact input lengths), with ``ignore_eos`` (exact
output lengths) and ``stream_options.include_usage``. Two shapes of load:

- a fixed set of ``--num-prompts`` requests, Poisson arrivals at ``--request-rate`` (inf: all
  at once), optionally capped at ``--max-concurrency`` in flight;
- ``--duration S``: ``--max-concurrency N`` clients, each sending its next request as soon as
  its last one ended, for S seconds, each request with a fresh prompt (``RequestSampler``: no
  prefix-cache hit but the shared-prefix dataset's prefix, so a P/D pair moves every prompt's
  KV).

Several ``--base-url``s share the requests in turn (instances behind no proxy).
``--check-metrics URL...`` then checks that every listed instance comes back to rest: no
request running or waiting and no KV block in use, within ``--settle-timeout``.

Each request carries ``X-Request-Id: <run id>-<index>``; ``run_load`` returns exactly one
RequestResult per request, and ``ok`` is only set for a request answered exactly once and
completely (a ``finish_reason`` of ``"error"`` is a failure), so another test can use it as a
load generator that checks nothing was lost or duplicated:
``assert all(r.ok for r in await run_load(...))``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

import httpx
import numpy as np
from tqdm import tqdm

from pagedkv.entrypoints.bench.datasets import BenchRequest, RequestSampler
from pagedkv.entrypoints.bench.plot import plot_results
from pagedkv.entrypoints.bench.results import (
    RequestResult,
    format_summary,
    save_json,
    summarize,
)
from pagedkv.entrypoints.bench.settle import wait_settled


def _is_answer_to(chunk_id: str, request_id: str) -> bool:
    """Chunk ids end with the request's ``X-Request-Id`` (behind ``pagedkv proxy``, a retried
    request's id gets a ``-retry<n>`` suffix)."""
    head, _, retry = chunk_id.rpartition("-retry")
    return chunk_id.endswith(request_id) or (retry.isdigit() and head.endswith(request_id))


class _StreamRecorder:
    """Reads one request's stream into its RequestResult: the arrival time of every choice,
    the finish reasons, ``[DONE]`` and usage, and the first protocol surprise as the
    result's error."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.token_times: list[float] = []
        self.num_finished = self.num_done = 0
        self.usage: dict | None = None

    def record(self, line: str) -> bool:
        """One line of the stream; False once the result has an error (read no further)."""
        if not line.startswith("data: "):
            return True
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            self.num_done += 1
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            self.result.error = f"stream error: {message}"
            return False
        if not _is_answer_to(chunk.get("id", ""), self.result.request_id):
            self.result.error = f"chunk of another request: {chunk.get('id')!r}"
            return False
        for choice in chunk["choices"]:
            self.token_times.append(time.perf_counter())
            if choice.get("finish_reason") is not None:
                self.num_finished += 1
                self.result.finish_reason = choice["finish_reason"]
        self.usage = chunk.get("usage") or self.usage
        return True

    def complete(self, start: float, end: float) -> RequestResult:
        """The result of a stream read to its end: ok only if it answered exactly once and
        completely."""
        result, usage, token_times = self.result, self.usage, self.token_times
        if (self.num_finished, self.num_done) != (1, 1) or usage is None or not token_times:
            result.error = (
                f"incomplete or repeated answer: {self.num_finished} finish reasons, "
                f"{self.num_done} [DONE], usage {'present' if usage else 'missing'}"
            )
        elif result.finish_reason == "error":
            result.error = "finished with finish_reason 'error' (the server's log says why)"
        else:
            result.ok = True
            result.ttft = token_times[0] - start
            result.itl = [b - a for a, b in zip(token_times, token_times[1:])]
            result.e2e = end - start
            result.prompt_tokens = usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens", 0)
            result.output_tokens = usage["completion_tokens"]
        return result


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    request: BenchRequest,
    index: int,
    request_id: str,
    t0: float,
) -> RequestResult:
    """Stream one completion; every protocol surprise is recorded as the result's error."""
    payload = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result = RequestResult(index=index, request_id=request_id, start_time=start - t0)
    recorder = _StreamRecorder(result)
    try:
        async with client.stream(
            "POST",
            f"{base_url}/v1/completions",
            json=payload,
            headers={"X-Request-Id": request_id},
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                if not recorder.record(line):
                    return result
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        # TypeError, AttributeError: a chunk of the wrong shape (not an object, choices None)
        result.error = f"{type(e).__name__}: {e}"
        return result
    return recorder.complete(start, time.perf_counter())


async def _open_loop(
    send: Callable[[int], Awaitable[RequestResult]],
    num_requests: int,
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
) -> list[RequestResult]:
    """Requests ``0 .. num_requests - 1`` at Poisson arrivals (all at once at an infinite
    rate), at most ``max_concurrency`` in flight; results in request order."""
    rng = np.random.default_rng(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def one(index: int) -> RequestResult:
        async with limit:
            return await send(index)

    tasks = []
    for index in range(num_requests):
        tasks.append(asyncio.create_task(one(index)))
        if math.isfinite(request_rate):
            await asyncio.sleep(rng.exponential(1.0 / request_rate))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(
    send: Callable[[int], Awaitable[RequestResult]], num_clients: int, until: float
) -> list[RequestResult]:
    """``num_clients`` clients, each sending the next request as soon as its last one ended,
    until ``until`` (``time.perf_counter``); results in request order."""
    indices = itertools.count()

    async def client_loop() -> list[RequestResult]:
        done = []
        while time.perf_counter() < until:
            done.append(await send(next(indices)))
        return done

    per_client = await asyncio.gather(*(client_loop() for _ in range(num_clients)))
    return sorted((r for rs in per_client for r in rs), key=lambda r: r.index)


async def run_load(
    base_url: str | Sequence[str],
    model: str,
    requests: Sequence[BenchRequest] | RequestSampler,
    *,
    api_key: str | None = None,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    duration: float | None = None,
    seed: int = 0,
    timeout: float = 600.0,
    progress: bool = False,
) -> tuple[list[RequestResult], float]:
    """Send every request once, or (``duration``) keep ``max_concurrency`` clients busy for
    that many seconds: request ``i`` is ``requests[i]`` from a ``RequestSampler``, or from a list
    reused in turn. Request ``i`` goes to base URL ``i % len(base_urls)``. Returns ``(results
    in request order, duration in seconds)``."""
    base_urls = [base_url] if isinstance(base_url, str) else list(base_url)
    if not base_urls:
        raise ValueError("run_load needs at least one base URL")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if duration is not None and max_concurrency is None:
        raise ValueError("a run for a duration needs max_concurrency >= 1 (the clients)")
    sampled = isinstance(requests, RequestSampler)
    if sampled and duration is None:
        raise ValueError("requests from a RequestSampler need a duration (they never run out)")
    run_id = uuid.uuid4().hex[:8]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    bar = tqdm(total=None if duration else len(requests), disable=not progress, desc="requests")
    t0 = time.perf_counter()
    connections = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=connections) as client:

        async def send(index: int) -> RequestResult:
            request = requests[index] if sampled else requests[index % len(requests)]
            url = base_urls[index % len(base_urls)]
            request_id = f"bench-{run_id}-{index}"
            result = await send_request(client, url, model, request, index, request_id, t0)
            bar.update(1)
            return result

        if duration is None:
            results = await _open_loop(send, len(requests), request_rate, max_concurrency, seed)
        else:
            assert max_concurrency is not None
            results = await _closed_loop(send, max_concurrency, t0 + duration)
    elapsed = time.perf_counter() - t0
    bar.close()
    return results, elapsed


def _server_model(base_url: str, api_key: str | None, timeout: float) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=timeout)
    response.raise_for_status()
    return response.json()["data"][0]


def _model_and_requests(
    args: argparse.Namespace, base_url: str
) -> tuple[str, list[BenchRequest] | RequestSampler]:
    """The model to ask for and the requests (a sampler for ``--duration``), checked against
    the server's model card: a bad workload ends the command with one line."""
    try:
        card = _server_model(base_url, args.api_key, args.timeout)
    except (httpx.HTTPError, KeyError, IndexError) as e:
        sys.exit(f"pagedkv bench serve: cannot list the models of {base_url}: {e}")
    model = args.model or card["id"]
    prefix_len = args.prefix_len if args.dataset == "shared-prefix" else 0
    max_model_len = card.get("max_model_len")
    needed = prefix_len + args.input_len + args.output_len
    if max_model_len is not None and needed > max_model_len:
        sys.exit(
            f"pagedkv bench serve: prompts of {prefix_len + args.input_len} tokens plus "
            f"{args.output_len} output tokens exceed the server's max_model_len {max_model_len}"
        )
    try:
        sampler = RequestSampler(
            args.dataset,
            args.input_len,
            args.output_len,
            vocab_size=args.vocab_size,
            seed=args.seed,
            prefix_len=prefix_len,
        )
    except ValueError as e:
        sys.exit(f"pagedkv bench serve: {e}")
    return model, sampler if args.duration is not None else sampler.first(args.num_prompts)


def _instances_at_rest(args: argparse.Namespace, summary: dict) -> bool:
    """With ``--check-metrics``: waits for the instances to come back to rest, prints and
    records in ``summary`` which did."""
    if not args.check_metrics:
        return True
    states = wait_settled(args.check_metrics, args.settle_timeout)
    summary["instances"] = {s.base_url: s.settled for s in states}
    print(f"Instances after {args.settle_timeout:g} s at most:")
    for state in states:
        print(f"  {state.describe()}")
    return all(s.settled for s in states)


def _write_results(
    args: argparse.Namespace, model: str, summary: dict, results: list[RequestResult]
) -> None:
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
    config.update(model=model, request_rate=str(args.request_rate))
    if args.result_json:
        save_json(args.result_json, config, summary, results)
    if args.plot:
        try:
            plot_results(results, summary, args.plot)
        except ImportError:
            print("--plot needs matplotlib: pip install 'pagedkv[bench]'", file=sys.stderr)


def run_bench_serve(args: argparse.Namespace) -> None:
    base_urls = [url.rstrip("/") for url in args.base_url]
    if args.duration is not None and args.max_concurrency is None:
        sys.exit("pagedkv bench serve: --duration S needs --max-concurrency N (the clients)")
    model, requests = _model_and_requests(args, base_urls[0])
    results, duration = asyncio.run(
        run_load(
            base_urls,
            model,
            requests,
            api_key=args.api_key,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            duration=args.duration,
            seed=args.seed,
            timeout=args.timeout,
            progress=not args.disable_tqdm,
        )
    )
    summary = summarize(results, duration)
    print(format_summary(summary))
    at_rest = _instances_at_rest(args, summary)
    _write_results(args, model, summary, results)
    if summary["failed"] or not at_rest:
        sys.exit(1)
