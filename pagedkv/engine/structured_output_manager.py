"""StructuredOutputManager: the engine's side of structured outputs.

Per step, around the model:

    schedule()  ->  grammar_bitmask(rows that sample)   ->  execute_model(..., bitmask)
                                                               (the sampler masks those rows)
    update_from_output()  ->  accept_tokens(new tokens)  ->  requests whose grammar is complete

A row that does not sample this step (a prefill chunk short of the prompt's end) gets no mask.
"""

from __future__ import annotations

import numpy as np

from pagedkv.engine.outputs import EngineCoreOutput
from pagedkv.engine.request import Request
from pagedkv.sampling_params import StructuredOutputsParams
from pagedkv.structured_output.backend_guidance import CompileStats, Grammar, GuidanceBackend
from pagedkv.worker.scheduler_output import GrammarBitmask


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_id = eos_token_id
        self._backend: GuidanceBackend | None = None

    def grammar_for(self, params: StructuredOutputsParams) -> Grammar:
        """A new request's grammar (compiled once per distinct grammar). ValueError if it
        cannot be compiled; the message names the problem."""
        if self._tokenizer is None:
            raise ValueError("structured_outputs need the model's tokenizer, and it has none")
        if self._backend is None:
            self._backend = GuidanceBackend(self._tokenizer, self._vocab_size, self._eos_token_id)
        return self._backend.compile(params)

    @property
    def in_use(self) -> bool:
        """Whether any request ever had a grammar (until then a step skips this manager)."""
        return self._backend is not None

    def compile_stats(self) -> CompileStats:
        if self._backend is None:
            return CompileStats(0, 0.0, 0)
        return self._backend.stats()

    def grammar_bitmask(self, requests: list[Request]) -> GrammarBitmask | None:
        """Masks for the scheduled requests that have a grammar and sample this step (all of
        their known tokens are computed once this step's tokens are)."""
        sampling = [
            r for r in requests if r.grammar is not None and r.num_computed_tokens >= r.num_tokens
        ]
        if not sampling:
            return None
        assert self._backend is not None
        bitmask = np.empty((len(sampling), self._backend.num_bitmask_words), dtype=np.int32)
        for row, request in enumerate(sampling):
            request.grammar.fill_bitmask(bitmask, row)
        return GrammarBitmask([r.request_id for r in sampling], bitmask)

    @staticmethod
    def accept_tokens(
        core_outputs: list[EngineCoreOutput], requests: dict[str, Request]
    ) -> list[str]:
        """Advance each constrained request's grammar by its new tokens; returns the requests
        still running whose grammar is now complete (they stop: only EOS could follow)."""
        completed = []
        for core in core_outputs:
            request = requests.get(core.request_id)
            if request is None or request.grammar is None or not core.new_token_ids:
                continue
            request.grammar.accept_tokens(core.new_token_ids)
            if request.grammar.is_terminated and core.finish_reason is None:
                completed.append(core.request_id)
        return completed
