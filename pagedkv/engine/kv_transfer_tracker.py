"""KVTransferTracker: the scheduler's record of the transfers its KV connector runs.

A transfer keeps a request's blocks beyond what the V1 scheduler itself tracks. Per request::

    load (consumer): admitted, load_async
        -> LOADING (status WAITING_FOR_REMOTE_KVS; cancelled once, if its deadline passes:
                    ``load_timeout`` after admission, pushed forward each time the
                    connector reports the load in progress)
            -- finished_recving --> LOADED -- promote_if_loaded --> status WAITING
            -- finished_recving, its blocks bad under "fail" --> the request ends with an error
            -- the request ends --> ENDED_WHILE_LOADING -- finished_recving --> blocks freed
    send (producer): the request ends and the connector holds its blocks
        -> SENDING -- finished_sending --> blocks freed

The connector ends every load and every send exactly once (``kv_connector/base.py``), so every
block held here is freed. Block facts come from ``KVCacheManager`` only.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from pagedkv.engine.request import Request, RequestStatus
from pagedkv.kv_cache.kv_cache_manager import KVCacheManager
from pagedkv.kv_connector.base import KVConnectorBase
from pagedkv.kv_connector.output import KVConnectorOutput


class ExternalTokens(NamedTuple):
    """What the connector provides for a request being admitted, past its local prefix hit."""

    num_tokens: int
    #: Loaded between steps: the request waits in WAITING_FOR_REMOTE_KVS meanwhile.
    load_async: bool


NO_EXTERNAL_TOKENS = ExternalTokens(0, False)


class TransferPhase(enum.Enum):
    LOADING = "loading"
    LOADED = "loaded"
    ENDED_WHILE_LOADING = "ended while loading"
    SENDING = "sending"


class TransferResults(NamedTuple):
    """What a step's connector report asks of the scheduler's queues."""

    #: Requests to end with an error (with the reason): waiting ones whose load failed, and
    #: running ones whose step read bad KV, under the "fail" policy.
    failed: list[tuple[Request, str]]
    #: Running requests whose step read bad KV, under "recompute": to redo from the first bad
    #: block (their ``num_computed_tokens`` is already cut back).
    redo: list[Request]


@dataclass(slots=True)
class _Load:
    request: Request
    #: When the load counts as failed (the tracker's clock).
    deadline: float
    cancelled: bool = False
    #: Why it failed, once its blocks were reported bad under the "fail" policy.
    failure: str | None = None


class KVTransferTracker:
    def __init__(
        self,
        connector: KVConnectorBase | None,
        kv_cache_manager: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        #: Load deadlines' clock (monotonic seconds; tests drive their own).
        self.clock = clock
        self._loading: dict[str, _Load] = {}
        #: Loads that ended, whose request is not promoted yet.
        self._loaded: set[str] = set()
        self._ended_while_loading: dict[str, Request] = {}
        self._sending: dict[str, Request] = {}

    @property
    def holds_blocks(self) -> bool:
        """Finished requests still hold blocks (a send, or a load, not ended yet)."""
        return bool(self._sending or self._ended_while_loading)

    def phase(self, request_id: str) -> TransferPhase | None:
        if request_id in self._loading:
            return TransferPhase.LOADING
        if request_id in self._loaded:
            return TransferPhase.LOADED
        if request_id in self._ended_while_loading:
            return TransferPhase.ENDED_WHILE_LOADING
        if request_id in self._sending:
            return TransferPhase.SENDING
        return None

    # ------------------------------------------------------------------ admission
    def get_external_tokens(self, request: Request, num_hit: int) -> ExternalTokens | None:
        """The connector's tokens for a request admitted for the first time; None when it does
        not know yet (ask again next step)."""
        if self.connector is None:
            return NO_EXTERNAL_TOKENS
        num_tokens, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        if num_tokens is None:
            return None
        load_async = load_async and num_tokens > 0
        if not load_async:  # the last prompt token is computed here, for its logits
            num_tokens = min(num_tokens, request.num_tokens - 1 - num_hit)
        return ExternalTokens(num_tokens, load_async)

    def on_allocated(self, request: Request, external: ExternalTokens) -> None:
        """Blocks were allocated for the request's first admission. An async load starts: the
        request waits in WAITING_FOR_REMOTE_KVS until the load ends."""
        if self.connector is None:
            return
        blocks = self.kv_cache_manager.get_blocks(request.request_id)
        self.connector.update_state_after_alloc(request, blocks, external.num_tokens)
        if external.load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            deadline = self.clock() + self.connector.load_timeout
            self._loading[request.request_id] = _Load(request, deadline)

    def promote_if_loaded(self, request: Request) -> bool:
        """True once the request's load has ended: it then computes what is missing (at least
        the last prompt token, whose logits give the first output token)."""
        if request.request_id not in self._loaded:
            return False
        self._loaded.discard(request.request_id)
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        request.num_cached_tokens = request.num_computed_tokens
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING
        return True

    def cancel_overdue_loads(self) -> None:
        """A load past its deadline is cancelled (once); the connector then ends it as failed."""
        now = self.clock()
        for load in self._loading.values():
            if not load.cancelled and now > load.deadline:
                load.cancelled = True
                assert self.connector is not None
                self.connector.cancel_load(load.request)

    # ------------------------------------------------------------------ endings
    def request_finished(self, request: Request) -> dict | None:
        """The request ended and is off the scheduler's queues: its blocks are freed now, or
        held until its send or its (now cancelled) load ends. Returns the connector's
        ``kv_transfer_params`` for the response."""
        request_id = request.request_id
        kv = self.kv_cache_manager
        self._loaded.discard(request_id)
        load = self._loading.pop(request_id, None)
        hold, params = False, None
        if self.connector is not None:
            if load is not None:
                self.connector.cancel_load(request)
            hold, params = self.connector.request_finished(request, kv.get_block_ids(request_id))
        if not kv.is_allocated(request_id):
            return params
        if load is not None:
            self._ended_while_loading[request_id] = request
        elif hold:
            self._sending[request_id] = request
        else:
            kv.free(request)
        return params

    # ------------------------------------------------------------------ the connector's report
    def update_from_output(
        self, output: KVConnectorOutput, requests: Iterable[Request]
    ) -> TransferResults:
        """Apply a step's ended sends, ended loads, loads in progress and bad blocks.
        ``requests``: every unfinished request (bad blocks may be shared through the prefix
        cache)."""
        assert self.connector is not None
        kv = self.kv_cache_manager
        self.connector.update_connector_output(output)
        self._renew_deadlines(output.loads_in_progress)
        for request_id in output.finished_sending:
            request = self._sending.pop(request_id, None)
            if request is not None:
                kv.free(request)
        results = TransferResults([], [])
        if output.invalid_block_ids:
            self._apply_invalid_blocks(
                output.invalid_block_ids, output.load_errors, requests, results
            )
        for request_id in output.finished_recving:
            ended = self._ended_while_loading.pop(request_id, None)
            if ended is not None:
                kv.free(ended)
                continue
            load = self._loading.pop(request_id, None)
            if load is None:  # a synchronous load: its request is running
                continue
            if load.failure is not None:
                results.failed.append((load.request, load.failure))
            else:
                self._loaded.add(request_id)
        return results

    def _renew_deadlines(self, request_ids: Iterable[str]) -> None:
        """The source of these loads still computes their KV: each deadline counts from now
        (a load already cancelled stays cancelled)."""
        assert self.connector is not None
        deadline = self.clock() + self.connector.load_timeout
        for request_id in request_ids:
            load = self._loading.get(request_id)
            if load is not None and not load.cancelled:
                load.deadline = max(load.deadline, deadline)

    def _apply_invalid_blocks(
        self,
        invalid_block_ids: set[int],
        load_errors: dict[str, str],
        requests: Iterable[Request],
        results: TransferResults,
    ) -> None:
        """A failed load is a set of block ids. Under the "recompute" policy the affected
        request keeps the KV before the first bad block and computes the rest itself; under
        "fail" it ends with an error (the policy the connector gives for that request). Bad blocks
        never stay in the prefix cache."""
        connector = self.connector
        assert connector is not None
        kv = self.kv_cache_manager
        kv.evict_invalid_blocks(invalid_block_ids)
        for request in requests:
            request_id = request.request_id
            first_bad = kv.first_token_in_blocks(request_id, invalid_block_ids)
            if first_bad is None:
                continue
            fail = connector.load_failure_policy_for(request) == "fail"
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                load = self._loading.get(request_id)
                if not fail:
                    request.num_computed_tokens = min(request.num_computed_tokens, first_bad)
                elif load is not None:
                    why = load_errors.get(request_id, "its blocks did not arrive")
                    load.failure = (
                        f"loading the KV cache from another instance failed: {why} "
                        "(kv_load_failure_policy=fail)"
                    )
            elif request.status == RequestStatus.RUNNING:
                # This step's tokens attended to the bad KV: nothing from the first bad block on
                # may be hit by another request.
                kv.evict_blocks_from(request_id, first_bad)
                if fail:
                    reason = "loading the KV cache failed (kv_load_failure_policy=fail)"
                    results.failed.append((request, reason))
                else:
                    request.num_computed_tokens = min(request.num_computed_tokens, first_bad)
                    results.redo.append(request)
