"""The proxy's ``/metrics``: how requests were routed, and how well the KV index predicted.

A request answered whole by one instance (a replica, or a D prefilling itself) whose answer
reports ``usage.prompt_tokens_details.cached_tokens`` (non-streamed, or streamed with
``stream_options.include_usage``) adds its predicted hit tokens and the instance's realized
ones to the two counters, so their ratio is the index's accuracy; a wrong prediction costs
only recompute. Per instance: the index's cached block count per medium (its pool "GPU", its
tiers "CPU", "DISK", ...) and the KV event feed's health.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedkv.kv_events.feed import FeedStats

_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def cached_tokens(body: bytes) -> int | None:
    """The last ``cached_tokens`` in an answer (its usage), or None when it has none."""
    found = _CACHED_TOKENS.findall(body)
    return int(found[-1]) if found else None


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pagedkv:proxy_requests",
            "Requests routed, by how: whole (one instance) or disaggregated (P and D).",
            ["mode"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "pagedkv:proxy_prompt_tokens",
            "Prompt tokens of routed requests, as the proxy tokenized them.",
            registry=self.registry,
        )
        self.predicted_hit_tokens = Counter(
            "pagedkv:proxy_predicted_hit_tokens",
            "Prompt tokens the KV index predicted the chosen instance had cached (requests "
            "answered whole, with usage reported).",
            registry=self.registry,
        )
        self.realized_hit_tokens = Counter(
            "pagedkv:proxy_realized_hit_tokens",
            "Prompt tokens the chosen instance reported cached (the same requests).",
            registry=self.registry,
        )
        self.exact_predictions = Counter(
            "pagedkv:proxy_exact_hit_predictions",
            "Requests whose predicted hit equalled the realized one.",
            registry=self.registry,
        )
        self.predictions = Counter(
            "pagedkv:proxy_hit_predictions",
            "Requests with both a predicted and a realized hit.",
            registry=self.registry,
        )

    def observe_hit(self, predicted: int, realized: int) -> None:
        self.predicted_hit_tokens.inc(predicted)
        self.realized_hit_tokens.inc(realized)
        self.predictions.inc()
        if predicted == realized:
            self.exact_predictions.inc()

    def watch_index(
        self,
        cached_blocks: Callable[[str], dict[str, int]],
        feeds: Callable[[], dict[str, FeedStats]],
    ) -> None:
        self.registry.register(_IndexCollector(cached_blocks, feeds))


class _IndexCollector:
    """Per instance: blocks in the index per medium, the feed's lag, gaps, replays and
    snapshots."""

    def __init__(
        self,
        cached_blocks: Callable[[str], dict[str, int]],
        feeds: Callable[[], dict[str, FeedStats]],
    ) -> None:
        self._cached_blocks = cached_blocks
        self._feeds = feeds

    def collect(self) -> Iterator[Metric]:
        feeds = self._feeds()
        blocks = GaugeMetricFamily(
            "pagedkv:proxy_kv_index_cached_blocks",
            "Blocks the KV index holds for the instance, by medium (GPU: its pool).",
            labels=["instance", "medium"],
        )
        lag = GaugeMetricFamily(
            "pagedkv:proxy_kv_events_lag_seconds",
            "Publication to arrival of the instance's last KV event batch.",
            labels=["instance"],
        )
        counters = {
            name: CounterMetricFamily(
                f"pagedkv:proxy_kv_events_{name}", f"KV event feed: {name}", labels=["instance"]
            )
            for name in ("batches", "gaps", "replays", "snapshots", "restarts", "reconnects")
        }
        for name, stats in feeds.items():
            for medium, num_blocks in self._cached_blocks(name).items():
                blocks.add_metric([name, medium], num_blocks)
            lag.add_metric([name], stats.last_lag_s or 0.0)
            for counter, family in counters.items():
                family.add_metric([name], getattr(stats, f"num_{counter}"))
        yield blocks
        yield lag
        yield from counters.values()
