"""Request: one generation's state on the engine side (never any tensor)."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.kv_cache.block_hash import BlockHash, BlockHasher
from pagedkv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedkv.structured_output.backend_guidance import Grammar


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Every status after PREEMPTED is final.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Prompt plus the tokens generated so far; ``num_computed_tokens`` of them have KV.

    ``block_hashes`` grows as tokens arrive (each full block hashed once), so the prefix cache
    can find this request's blocks without rehashing.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_id: int | None = None,
        block_hasher: BlockHasher | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        grammar: Grammar | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.kv_transfer_params = kv_transfer_params
        #: The structured-output matcher (``structured_output.Grammar``), when constrained.
        self.grammar = grammar
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.num_computed_tokens = 0
        #: Prompt tokens served from the local prefix cache or a KV connector at admission.
        self.num_cached_tokens = 0
        self._all_token_ids = list(prompt_token_ids)
        self._output_token_ids: list[int] = []
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            block_hasher.update(self.block_hashes, self._all_token_ids, cache_salt)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self._block_hasher.update(self.block_hashes, self._all_token_ids, self.cache_salt)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
