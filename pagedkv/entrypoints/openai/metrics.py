"""Prometheus metrics with vLLM's names under a ``pagedkv:`` prefix.

A PrometheusStatLogger is an AsyncLLM stat logger: the engine thread calls ``record`` after
every step. It writes into the registry it is given, so two servers can share a process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.scheduler_stats import SchedulerStats
from pagedkv.kv_connector.histogram import HistogramStat

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
_TTFT_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)
_ITL_BUCKETS += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0)
_E2E_BUCKETS += (40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

#: Counter name -> the cumulative SchedulerStats field it follows.
_COUNTERS = {
    "pagedkv:prefix_cache_queries": ("prefix_cache_queries", "Prefix-cache lookups, in tokens."),
    "pagedkv:prefix_cache_hits": ("prefix_cache_hits", "Prefix-cache hits, in tokens."),
    "pagedkv:num_preemptions": ("num_preemptions", "Requests preempted (by recompute)."),
    "pagedkv:prompt_tokens": ("num_prompt_tokens", "Prompt tokens computed (prefill)."),
    "pagedkv:generation_tokens": ("num_generation_tokens", "Tokens generated."),
    "pagedkv:engine_steps": ("num_steps", "Engine steps run."),
    "pagedkv:batched_steps": ("num_batched_steps", "Engine steps whose batch held >1 request."),
}


class PrometheusStatLogger:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(
                model_name
            )

        self.num_requests_running = gauge(
            "pagedkv:num_requests_running", "Requests in the running batch."
        )
        self.num_requests_waiting = gauge(
            "pagedkv:num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.kv_cache_usage = gauge(
            "pagedkv:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)."
        )
        self.max_batch_size = gauge(
            "pagedkv:max_batch_size", "Most requests one engine step has batched so far."
        )
        self.counters = {
            field: Counter(name, doc, labels, registry=registry).labels(model_name)
            for name, (field, doc) in _COUNTERS.items()
        }
        self._last = dict.fromkeys(self.counters, 0)
        self.request_success = Counter(
            "pagedkv:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.model_name = model_name
        self.time_to_first_token = histogram(
            "pagedkv:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "pagedkv:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "pagedkv:e2e_request_latency_seconds", "Arrival to finish, per request.", _E2E_BUCKETS
        )

    def record(self, stats: SchedulerStats, finished: list[RequestOutput]) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.max_batch_size.set(stats.max_batch_size)
        for field, counter in self.counters.items():
            value = getattr(stats, field)
            if value > self._last[field]:
                counter.inc(value - self._last[field])
                self._last[field] = value
        for output in finished:
            self.request_success.labels(self.model_name, output.outputs[0].finish_reason).inc()
            metrics = output.metrics
            if metrics.time_to_first_token is not None:
                self.time_to_first_token.observe(metrics.time_to_first_token)
            for latency in metrics.inter_token_latencies:
                self.inter_token_latency.observe(latency)
            if metrics.e2e_latency is not None:
                self.e2e_request_latency.observe(metrics.e2e_latency)


class KVTransferCollector:
    """A KV connector's counters (``get_kv_connector_stats``), or another component's, read at
    each scrape: ``pagedkv:<prefix>_<name>`` (counters for ``num_*``, histograms for a
    ``HistogramStat``, gauges otherwise)."""

    def __init__(
        self,
        stats: Callable[[], dict[str, int | float | HistogramStat]],
        model_name: str,
        prefix: str = "kv_transfer",
    ) -> None:
        self._stats = stats
        self._model_name = model_name
        self._prefix = prefix

    def collect(self) -> Iterator[Metric]:
        for name, value in sorted(self._stats().items()):
            if isinstance(value, HistogramStat):
                histogram = HistogramMetricFamily(
                    f"pagedkv:{self._prefix}_{name}",
                    f"{self._prefix}: {name}",
                    labels=["model_name"],
                )
                histogram.add_metric([self._model_name], value.cumulative(), value.total)
                yield histogram
                continue
            family = CounterMetricFamily if name.startswith("num_") else GaugeMetricFamily
            metric = family(
                f"pagedkv:{self._prefix}_{name}", f"{self._prefix}: {name}", labels=["model_name"]
            )
            metric.add_metric([self._model_name], value)
            yield metric
