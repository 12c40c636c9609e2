"""InputBatch: the worker's persistent per-request rows.

Rows ``[0, num_reqs)`` are dense: removing a request moves the last row into its hole. Each row
holds the request's token ids (prompt, then sampled tokens as the worker produces them: its
output tokens are ``token_ids_cpu[row, num_prompt_tokens:num_tokens]``), its computed-token
count, whether it samples by argmax alone (``plain``) and, per KV cache group, its block table
row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedkv.kv_cache.block_table import MultiGroupBlockTable
from pagedkv.model.sampler import SAMPLING_EPS
from pagedkv.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    #: Prompt positions whose logprobs were computed: a request preempted and computed again
    #: from its first token must not send them twice.
    num_prompt_logprobs_computed: int = 0
    #: Greedy, with nothing else that acts on its logits or its output (penalties, logprobs,
    #: prompt logprobs, min_tokens, a grammar): a step whose sampled rows are all plain samples
    #: them by one argmax, with no per-row work.
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.sampling_params
        self.plain = (
            params.temperature < SAMPLING_EPS
            and not params.has_penalties
            and params.logprobs is None
            and params.prompt_logprobs is None
            and params.min_tokens == 0
            and params.structured_outputs is None
        )


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_sizes: list[int],
        max_num_blocks_per_req: list[int],
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.states: list[CachedRequestState] = []
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.plain = np.zeros(max_num_reqs, dtype=bool)
        self.block_table = MultiGroupBlockTable(block_sizes, max_num_reqs, max_num_blocks_per_req)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(
        self,
        state: CachedRequestState,
        token_ids: list[int],
        num_computed_tokens: int,
        block_ids: tuple[list[int], ...],
    ) -> None:
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id!r} is already in the batch")
        if len(self.req_ids) >= self.max_num_reqs:
            raise ValueError(f"the batch already holds max_num_reqs={self.max_num_reqs} requests")
        row = len(self.req_ids)
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.req_id_to_index[state.req_id] = row
        n = len(token_ids)
        self.token_ids_cpu[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = num_computed_tokens
        self.plain[row] = state.plain
        self.block_table.add_row(block_ids, row)

    def remove_request(self, req_id: str) -> None:
        """Drop a request; the last row moves into its place to keep rows dense."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.states[row] = self.states[last]
            self.req_id_to_index[moved] = row
            n = self.num_tokens[last]
            self.token_ids_cpu[row, :n] = self.token_ids_cpu[last, :n]
            self.num_tokens[row] = n
            self.num_computed_tokens[row] = self.num_computed_tokens[last]
            self.plain[row] = self.plain[last]
            self.block_table.move_row(last, row)
        else:
            self.block_table.clear_row(row)
        self.req_ids.pop()
        self.states.pop()

    def append_tokens(self, rows: np.ndarray, token_ids: list[int]) -> None:
        """Append ``token_ids[i]`` to row ``rows[i]`` (rows distinct); a row already at
        ``max_model_len`` tokens keeps them (the scheduler ends it by length)."""
        ends = self.num_tokens[rows]
        room = ends < self.max_model_len
        if not room.all():
            rows, ends = rows[room], ends[room]
            token_ids = np.asarray(token_ids, dtype=np.int64)[room]
        self.token_ids_cpu[rows, ends] = token_ids
        self.num_tokens[rows] = ends + 1

    def output_token_ids(self, row: int) -> np.ndarray:
        """The row's sampled tokens so far (a view)."""
        return self.token_ids_cpu[row, self.states[row].num_prompt_tokens : self.num_tokens[row]]
