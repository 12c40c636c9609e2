"""Turns the scheduler's per-step deltas into RequestOutputs: text, logprobs, stop strings."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    RequestMetrics,
    RequestOutput,
)
from pagedkv.engine.request import Request
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.worker.model_runner_output import Logprobs


def _as_dict(entry: Logprobs) -> dict[int, float]:
    return dict(zip(entry.token_ids, entry.logprobs))


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    token_ids: list[int]
    text: str = ""
    #: Length of ``text`` that may be streamed: text that could still be the start of a stop
    #: string is held back.
    num_stable_chars: int = 0
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request: Request, prompt: str | None) -> None:
        params = request.sampling_params
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
            )
        self.states[request.request_id] = RequestState(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=params,
            detokenizer=detok,
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            token_ids=[],
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        state.finish_reason = "abort"
        state.metrics.finished_time = time.monotonic()
        return self._make_output(state, finished=True)

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs, and the requests a stop string ended (the caller finishes them
        in the scheduler so they stop generating)."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        for core in core_outputs:
            state = self.states.get(core.request_id)
            if state is None:
                continue
            if core.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(_as_dict(e) for e in core.new_prompt_logprobs)
            if core.new_token_ids:
                metrics = state.metrics
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.token_times.extend([now] * len(core.new_token_ids))
                state.token_ids.extend(core.new_token_ids)
                if state.logprobs is not None and core.new_logprobs:
                    state.logprobs.extend(_as_dict(e) for e in core.new_logprobs)
                if self._detokenize(state, core.new_token_ids, core.finish_reason is not None):
                    stopped.append(core.request_id)
            if state.finish_reason is None and core.finish_reason is not None:
                state.finish_reason = core.finish_reason
                state.stop_reason = core.stop_reason
            finished = state.finish_reason is not None
            if finished:
                state.metrics.finished_time = now
                del self.states[core.request_id]
            output = self._make_output(state, finished)
            output.num_cached_tokens = core.num_cached_tokens
            output.kv_transfer_params = core.kv_transfer_params
            output.error = core.error
            outputs.append(output)
        return outputs, stopped

    def _detokenize(self, state: RequestState, new_token_ids: list[int], final: bool) -> bool:
        """Append the new tokens' text; True if a stop string ended the request."""
        if state.detokenizer is None:
            return False
        params = state.sampling_params
        start = len(state.text)
        for token_id in new_token_ids:
            state.text += state.detokenizer.step(token_id)
        if final:
            state.text += state.detokenizer.flush()
        stops = params.stop
        if stops and len(state.token_ids) >= params.min_tokens:
            longest = max(map(len, stops))
            search_from = max(0, start - longest + 1)
            for stop in stops:
                pos = state.text.find(stop, search_from)
                if pos != -1:
                    end = pos + len(stop) if params.include_stop_str_in_output else pos
                    state.text = state.text[:end]
                    state.num_stable_chars = end
                    state.finish_reason, state.stop_reason = "stop", stop
                    return True
            if not final:
                # Hold back a tail that could be the start of a stop string.
                state.num_stable_chars = max(state.num_stable_chars, len(state.text) - longest + 1)
                return False
        state.num_stable_chars = len(state.text)
        return False

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        text = state.text if finished else state.text[: state.num_stable_chars]
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(state.token_ids),
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=state.metrics,
            prompt_logprobs=state.prompt_logprobs,
        )
