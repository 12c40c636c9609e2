"""Outputs: the scheduler's per-step deltas and the RequestOutput users receive."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.worker.model_runner_output import Logprobs


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from a step: new tokens and, when it ended, why."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    new_prompt_logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    error: str | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (``time.monotonic``) of one request."""

    arrival_time: float
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class Logprob:
    """vLLM's: one token's log-probability, its 1-based rank in the vocabulary, its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per position: ``{token_id: Logprob}`` for the chosen token and the top-k (vLLM's shape).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sequence of a request (``index`` among its ``n``)."""

    index: int
    text: str
    token_ids: list[int]
    #: Per generated token, when the request asked for logprobs.
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: Sum of the chosen tokens' logprobs (None unless logprobs were asked for), as in vLLM.
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    #: Per prompt token; None for the first token (it has no context).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    error: str | None = None


def merge_deltas(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive ``DELTA`` outputs of one request as one: each sequence's text, tokens,
    logprobs and prompt logprobs joined; finish, metrics and the rest from ``later``."""
    merged = {c.index: c for c in earlier.outputs}
    for c in later.outputs:
        before = merged.get(c.index)
        if before is None:
            merged[c.index] = c
            continue
        logprobs = before.logprobs
        if logprobs is not None and c.logprobs is not None:
            logprobs = logprobs + c.logprobs
        merged[c.index] = CompletionOutput(
            index=c.index,
            text=before.text + c.text,
            token_ids=before.token_ids + c.token_ids,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            cumulative_logprob=c.cumulative_logprob,
        )
    prompt_logprobs = earlier.prompt_logprobs
    if later.prompt_logprobs is not None:
        prompt_logprobs = (prompt_logprobs or []) + later.prompt_logprobs
    return RequestOutput(
        request_id=later.request_id,
        prompt=later.prompt,
        prompt_token_ids=later.prompt_token_ids,
        outputs=sorted(merged.values(), key=lambda c: c.index),
        finished=later.finished,
        metrics=later.metrics,
        prompt_logprobs=prompt_logprobs,
        num_cached_tokens=later.num_cached_tokens,
        kv_transfer_params=later.kv_transfer_params or earlier.kv_transfer_params,
        error=later.error or earlier.error,
    )
