"""Turns the scheduler's per-step deltas into RequestOutputs: text, logprobs, stop strings.

A request with ``n`` sequences runs in the scheduler as ``n`` child requests (one when
``n == 1``, under the request's own id). Each child keeps its own text and stop state; every
step that moves any child yields one RequestOutput for the parent, finished once every child
is. Its ``output_kind`` (vLLM's ``RequestOutputKind``) says what the output holds: all ``n``
completions from the start, in index order (``CUMULATIVE``); the completions that moved, with
only what is new since the last output (``DELTA``); or nothing until the request finishes,
then everything (``FINAL_ONLY``: no per-step outputs to build).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagedkv.engine.request import Request
from pagedkv.sampling_params import RequestOutputKind, SamplingParams
from pagedkv.worker.model_runner_output import Logprobs


@dataclass
class SequenceState:
    """One child request: sequence ``index`` of its parent."""

    request_id: str
    index: int
    parent: ParentState
    sampling_params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    #: Length of ``text`` that may be streamed: text that could still be the start of a stop
    #: string is held back.
    num_stable_chars: int = 0
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: What earlier ``DELTA`` outputs carried: characters of ``text``, tokens, the finish.
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    finish_sent: bool = False


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    sequences: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    error: str | None = None
    #: Prompt positions whose logprobs earlier ``DELTA`` outputs carried.
    num_sent_prompt_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        #: By child request id (what the scheduler reports).
        self.states: dict[str, SequenceState] = {}
        #: By the request id users hold.
        self.parents: dict[str, ParentState] = {}

    def add_request(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        """``children[i]`` computes sequence ``i`` of request ``request_id``."""
        first = children[0]
        parent = ParentState(
            request_id, prompt, first.prompt_token_ids, first.sampling_params.output_kind
        )
        if first.sampling_params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for index, child in enumerate(children):
            params = child.sampling_params
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, child.prompt_token_ids, params.skip_special_tokens
                )
            state = SequenceState(
                request_id=child.request_id,
                index=index,
                parent=parent,
                sampling_params=params,
                detokenizer=detok,
                metrics=RequestMetrics(arrival_time=child.arrival_time),
                logprobs=[] if params.logprobs is not None else None,
            )
            parent.sequences.append(state)
            self.states[child.request_id] = state
        self.parents[request_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [] if parent is None else [s.request_id for s in parent.sequences]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        now = time.monotonic()
        for state in parent.sequences:
            self.states.pop(state.request_id, None)
            if state.finish_reason is None:
                state.finish_reason = "abort"
                state.metrics.finished_time = now
        return self._make_output(parent, finished=True)

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns one output per request that moved, and the child requests a stop string
        ended (the caller finishes them in the scheduler so they stop generating)."""
        now = time.monotonic()
        moved: dict[str, ParentState] = {}
        stopped: list[str] = []
        for core in core_outputs:
            state = self.states.get(core.request_id)
            if state is None:
                continue
            parent = state.parent
            if core.new_prompt_logprobs and parent.prompt_logprobs is not None and not state.index:
                parent.prompt_logprobs.extend(self._as_dicts(core.new_prompt_logprobs))
            if core.new_token_ids:
                self._add_tokens(state, core, now)
                if self._detokenize(state, core.new_token_ids, core.finish_reason is not None):
                    stopped.append(core.request_id)
            if state.finish_reason is None and core.finish_reason is not None:
                state.finish_reason = core.finish_reason
                state.stop_reason = core.stop_reason
            if state.finish_reason is not None:
                state.metrics.finished_time = now
                del self.states[core.request_id]
            if state.index == 0:
                parent.num_cached_tokens = core.num_cached_tokens
            parent.kv_transfer_params = core.kv_transfer_params or parent.kv_transfer_params
            parent.error = core.error or parent.error
            moved[parent.request_id] = parent
        outputs = []
        for parent in moved.values():
            finished = parent.finished
            if finished:
                del self.parents[parent.request_id]
                parent.sequences[0].metrics.finished_time = now
            elif parent.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            outputs.append(self._make_output(parent, finished))
        return outputs, stopped

    def _add_tokens(self, state: SequenceState, core: EngineCoreOutput, now: float) -> None:
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.token_times.extend([now] * len(core.new_token_ids))
        state.token_ids.extend(core.new_token_ids)
        if state.logprobs is not None and core.new_logprobs:
            entries = self._as_dicts(core.new_logprobs)
            state.logprobs.extend(entries)
            for token_id, entry in zip(core.new_token_ids, entries):
                state.cumulative_logprob += entry[token_id].logprob

    def _as_dicts(self, entries: list[Logprobs]) -> list[PositionLogprobs]:
        """The chosen token (column 0, its rank in the vocabulary), then the top-k (ranks
        1..k), each with its text."""
        out = []
        for entry in entries:
            position: PositionLogprobs = {}
            for column, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs)):
                if token_id not in position:
                    rank = entry.rank if column == 0 else column
                    position[token_id] = Logprob(logprob, rank, self._token_text(token_id))
            out.append(position)
        return out

    def _token_text(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _detokenize(self, state: SequenceState, new_token_ids: list[int], final: bool) -> bool:
        """Append the new tokens' text; True if a stop string ended the sequence."""
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

    def _make_output(self, parent: ParentState, finished: bool) -> RequestOutput:
        delta = parent.output_kind is RequestOutputKind.DELTA
        completions = []
        for state in parent.sequences:
            done = state.finish_reason is not None
            num_chars = len(state.text) if done else state.num_stable_chars
            num_tokens = len(state.token_ids)
            first_char = first_token = 0
            if delta:
                first_char, first_token = state.num_sent_chars, state.num_sent_tokens
                sent = (first_token, first_char, state.finish_sent)
                if sent == (num_tokens, num_chars, done):
                    continue  # nothing new in this sequence
                state.num_sent_chars, state.num_sent_tokens = num_chars, num_tokens
                state.finish_sent = done
            logprobs = state.logprobs
            completions.append(
                CompletionOutput(
                    index=state.index,
                    text=state.text[first_char:num_chars],
                    token_ids=state.token_ids[first_token:],
                    logprobs=logprobs[first_token:] if logprobs is not None else None,
                    finish_reason=state.finish_reason,
                    stop_reason=state.stop_reason,
                    cumulative_logprob=state.cumulative_logprob if logprobs is not None else None,
                )
            )
        prompt_logprobs = parent.prompt_logprobs
        if delta and prompt_logprobs is not None:
            first = parent.num_sent_prompt_logprobs
            parent.num_sent_prompt_logprobs = len(prompt_logprobs)
            prompt_logprobs = prompt_logprobs[first:] or None
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=parent.sequences[0].metrics,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
            kv_transfer_params=parent.kv_transfer_params,
            error=parent.error,
        )
