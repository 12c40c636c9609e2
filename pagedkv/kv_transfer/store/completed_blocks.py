"""CompletedBlocks: which blocks each step's forward pass completes, per request: the blocks a
connector that keeps KV by block hash (the store, the offloading tiers) stores that step.

A tracked request's block ids (per KV cache group) follow the scheduler's output: all of them
when it is scheduled as new (again, after a preemption), the new ones each later step. Block
``i`` is complete once the request's computed tokens reach ``(i + 1) * block_size`` and its
hash is known; each is yielded once, from ``first_block`` (the first the request computes, or 0
for a connector that stores a whole prompt) on. A window-skipped position (the null block) is
never yielded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.kv_cache.kv_cache_block import NULL_BLOCK_ID
from pagedkv.kv_connector.protocols import ConnectorRequest, ScheduledStep


@dataclass(slots=True)
class TrackedRequest:
    request: ConnectorRequest
    block_ids: list[list[int]]
    #: Blocks ``[0, num_done_blocks)`` are yielded, or not this request's to store.
    num_done_blocks: int | None = None


#: A yielded block: its request, its position in the request, its group and its block id.
CompletedBlock = tuple[ConnectorRequest, int, int, int]


class CompletedBlocks:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.requests: dict[str, TrackedRequest] = {}

    def track(self, request: ConnectorRequest) -> None:
        """From its (first or next) allocation on; tracked once, across preemptions."""
        self.requests.setdefault(request.request_id, TrackedRequest(request, []))

    def forget(self, request_id: str) -> TrackedRequest | None:
        return self.requests.pop(request_id, None)

    def step(
        self,
        scheduler_output: ScheduledStep,
        first_token: Callable[[ConnectorRequest, int], int] = lambda request, computed: computed,
    ) -> list[CompletedBlock]:
        """The blocks this step completes. ``first_token(request, num_computed_tokens)``: where
        a request newly scheduled starts storing (default: what it computes)."""
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self.requests[new.req_id]
            tracked.block_ids = [list(ids) for ids in new.block_ids]  # type: ignore[attr-defined]
            first_block = first_token(tracked.request, new.num_computed_tokens) // self.block_size
            if tracked.num_done_blocks is None or tracked.num_done_blocks > first_block:
                tracked.num_done_blocks = first_block
        for cached in scheduler_output.scheduled_cached_reqs:
            tracked = self.requests[cached.req_id]
            for ids, new_ids in zip(tracked.block_ids, cached.new_block_ids):  # type: ignore[attr-defined]
                ids.extend(new_ids)
        completed: list[CompletedBlock] = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            self._add_completed(self.requests[req_id], num_tokens, completed)
        return completed

    def _add_completed(
        self, tracked: TrackedRequest, num_scheduled_tokens: int, completed: list[CompletedBlock]
    ) -> None:
        request = tracked.request
        num_full = min(
            (request.num_computed_tokens + num_scheduled_tokens) // self.block_size,
            len(request.block_hashes),
        )
        assert tracked.num_done_blocks is not None
        for i in range(tracked.num_done_blocks, num_full):
            for group_id, ids in enumerate(tracked.block_ids):
                if ids[i] != NULL_BLOCK_ID:
                    completed.append((request, i, group_id, ids[i]))
        tracked.num_done_blocks = max(tracked.num_done_blocks, num_full)
