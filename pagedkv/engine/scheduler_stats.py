"""Scheduler statistics: gauges for now, counters since start (Prometheus-friendly)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    #: Steps whose batch held more than one request.
    num_batched_steps: int = 0
    max_batch_size: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
