"""What the scheduler tells the worker each step (no policy left to decide, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pagedkv.kv_connector.base import KVConnectorMetadata
from pagedkv.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has no state for: new, or resumed after preemption (then
    ``token_ids`` includes the outputs so far, which are recomputed like a prompt)."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    """A request the worker already holds: only its newly allocated blocks travel."""

    req_id: str
    new_block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    #: Tokens to compute this step per request, in batch order (running first, then new).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    #: Requests the worker must forget (finished or aborted since the last step).
    finished_req_ids: set[str] = field(default_factory=set)
    #: Requests preempted since the last step: their rows go, their sampling state stays.
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class GrammarBitmask(NamedTuple):
    """``bitmask[i]`` is request ``req_ids[i]``'s: bit ``t % 32`` of word ``t // 32`` set =
    token ``t`` allowed (int32 words, llguidance's and xgrammar's layout)."""

    req_ids: list[str]
    bitmask: np.ndarray

    def allowed(self, vocab_size: int) -> np.ndarray:
        """Bool ``[len(req_ids), vocab_size]``: token ``t`` allowed for row ``i``. Tokens past
        the bitmask's width (a model vocabulary padded beyond the tokenizer's) are not."""
        bits = np.unpackbits(self.bitmask.view(np.uint8), axis=1, bitorder="little")
        allowed = np.zeros((len(self.req_ids), vocab_size), dtype=bool)
        width = min(vocab_size, bits.shape[1])
        allowed[:, :width] = bits[:, :width]
        return allowed
