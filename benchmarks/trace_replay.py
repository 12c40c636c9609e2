"""Replaying a Mooncake-format trace through one ``LLMEngine`` in this process (for
``tiered_cache.py``): each request is added at its scaled timestamp, the engine is stepped in
between, and each request's TTFT (from its scheduled arrival), prompt tokens and hit tokens
(``num_cached_tokens``: pool and connector hits) are kept, with the time of every pure decode
step (every scheduled request one token: no prefill in it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from mooncake_trace import BlockTokens, TraceRequest, scaled
from quiet_machine import OthersMeter

from pagedkv import SamplingParams
from pagedkv.engine.request_input import RequestInput


@dataclass
class ReplayResult:
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    hit_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0
    wall_s: float = 0.0
    #: CPU seconds of this process (every thread) over the replay: less sensitive to a
    #: shared machine than wall time.
    cpu_s: float = 0.0
    #: The share of the machine other processes used meanwhile.
    others_share: float = 0.0
    decode_steps: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return sum(self.hit_tokens) / sum(self.prompt_tokens)

    @property
    def throughput(self) -> float:
        """Prompt and output tokens per second of wall time, first arrival to last token."""
        return (sum(self.prompt_tokens) + self.output_tokens) / self.wall_s

    def ttft_percentile(self, q: float) -> float:
        return percentile(self.ttfts, q)


@dataclass(frozen=True)
class Summary:
    """Medians over repeated replays of one configuration (TTFT in seconds)."""

    runs: int
    hit_rate: float
    ttft_p50: float
    ttft_p99: float
    throughput: float
    cpu_s: float
    others_share: float

    @classmethod
    def of(cls, results: Sequence[ReplayResult]) -> Summary:
        def median(metric) -> float:
            return statistics.median(metric(r) for r in results)

        return cls(
            runs=len(results),
            hit_rate=median(lambda r: r.hit_rate),
            ttft_p50=median(lambda r: r.ttft_percentile(50)),
            ttft_p99=median(lambda r: r.ttft_percentile(99)),
            throughput=median(lambda r: r.throughput),
            cpu_s=median(lambda r: r.cpu_s),
            others_share=median(lambda r: r.others_share),
        )


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the two nearest ranks."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(max(round(q), 1), 99) - 1]


class StepTimer:
    """Times ``engine.step()`` and tells pure decode steps apart, by wrapping the scheduler's
    ``schedule`` on this engine only."""

    def __init__(self, engine) -> None:
        self.engine, self.decode_steps = engine, []
        self._last = None
        schedule = engine.scheduler.schedule

        def recording_schedule():
            self._last = schedule()
            return self._last

        engine.scheduler.schedule = recording_schedule

    def step(self) -> list:
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - start
        counts = self._last.num_scheduled_tokens.values() if self._last else ()
        if counts and all(n == 1 for n in counts):
            self.decode_steps.append(elapsed)
        return outputs


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max(1, max_tokens), ignore_eos=True)


def replay(
    engine, requests: Sequence[TraceRequest], tokens: BlockTokens, speedup: float
) -> ReplayResult:
    """Requests arrive at ``timestamp / speedup`` (the first at once); returns once all end."""
    with OthersMeter() as others:
        result = _replay(engine, requests, tokens, speedup)
    result.others_share = others.share
    return result


def _replay(
    engine, requests: Sequence[TraceRequest], tokens: BlockTokens, speedup: float
) -> ReplayResult:
    timer, result = StepTimer(engine), ReplayResult()
    origin = requests[0].timestamp
    start, cpu_start = time.monotonic(), time.process_time()
    due = [start + (r.timestamp - origin) / 1000 / speedup for r in requests]
    pending: dict[str, int] = {}
    ttfts: dict[int, float] = {}
    next_index = 0
    while next_index < len(requests) or engine.has_unfinished_requests():
        now = time.monotonic()
        while next_index < len(requests) and due[next_index] <= now:
            request = requests[next_index]
            params = greedy(scaled(request.output_length, tokens.block_size))
            prompt = tokens.prompt(request)
            arrival = RequestInput(prompt, params, arrival_time=due[next_index])
            pending[engine.add_request(arrival)] = next_index
            result.prompt_tokens.append(len(prompt))
            result.hit_tokens.append(0)
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, due[next_index] - time.monotonic()))
            continue
        for out in timer.step():
            index = pending[out.request_id]
            if index not in ttfts and out.outputs[0].token_ids:
                ttfts[index] = out.metrics.time_to_first_token
            if out.finished:
                result.hit_tokens[index] = out.num_cached_tokens
                result.output_tokens += len(out.outputs[0].token_ids)
                del pending[out.request_id]
    result.wall_s = time.monotonic() - start
    result.cpu_s = time.process_time() - cpu_start
    result.ttfts = [ttfts[i] for i in range(len(requests))]
    result.decode_steps = timer.decode_steps
    return result


def run_together(engine, prompts: Sequence[list[int]], max_tokens: int = 1) -> list:
    """Submit every prompt at once and step until all end; the final outputs in order."""
    ids = [engine.add_request(RequestInput(p, greedy(max_tokens))) for p in prompts]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[i] for i in ids]


def settle(engine, timeout_s: float = 30.0, quiet_s: float = 0.5) -> None:
    """Step an idle engine until its connector's counters stop moving for ``quiet_s`` (the
    background stores have landed), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last, quiet_since = None, time.monotonic()
    while time.monotonic() < deadline:
        engine.step()
        stats = engine.get_kv_connector_stats()
        if stats != last:
            last, quiet_since = stats, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        time.sleep(0.02)
