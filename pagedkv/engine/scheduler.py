"""Scheduler, vLLM V1 style: no prefill or decode phases.

Every step each request advances ``num_computed_tokens`` toward ``num_tokens`` under a token
budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). A prompt longer than
the remaining budget is chunked over several steps; a prefix-cache hit (or KV loaded by a
connector) starts it further along. Running requests go first; when the pool is out of blocks,
the newest running request (or the lowest-priority one) is preempted by recompute: its blocks are
freed and it waits again.

With a KV connector, a request whose KV arrives from elsewhere waits in
``WAITING_FOR_REMOTE_KVS`` (blocks allocated, nothing computed) until its load ends; a finished
request may keep its blocks while the connector sends from them. ``KVTransferTracker`` keeps
that state; the scheduler moves requests between its queues.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import NamedTuple

from pagedkv.engine.config import SchedulerConfig
from pagedkv.engine.kv_transfer_tracker import NO_EXTERNAL_TOKENS, KVTransferTracker
from pagedkv.engine.outputs import EngineCoreOutput
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.request_queue import create_request_queue
from pagedkv.engine.scheduler_stats import SchedulerStats
from pagedkv.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pagedkv.kv_connector.base import KVConnectorBase
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.worker.model_runner_output import ModelRunnerOutput
from pagedkv.worker.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


class AdmissionOutcome(enum.Enum):
    SCHEDULED = enum.auto()  # runs this step
    LOADING = enum.auto()  # blocks allocated; waits for its KV from the connector
    RETRY = enum.auto()  # the connector does not know yet: look again next step
    NO_ROOM = enum.auto()  # not enough blocks, or budget without chunking: admission stops


class Admission(NamedTuple):
    outcome: AdmissionOutcome
    #: Tokens to compute this step (SCHEDULED only).
    num_new_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        connector: KVConnectorBase | None = None,
    ) -> None:
        self.config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector
        self.max_model_len = scheduler_config.max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        #: Requests the worker must forget (or, if preempted, unbatch) at the next step.
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.kv_transfers = KVTransferTracker(connector, kv_cache_manager)
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        request_id = request.request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.kv_cache_manager.is_allocated(request_id):  # sending, or ended while loading
            raise ValueError(
                f"request id {request_id!r} is still in use: the KV transfer of an earlier "
                "request with this id has not ended"
            )
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if self.connector is not None:
            self.connector.on_new_request(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step loop (abort, stop string): free their blocks now
        (or, for a request whose KV is still arriving, once the cancelled load has ended)."""
        assert status.is_finished
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._remove_from_queue(request)
            request.status = status
            self._free_request(request)

    def _remove_from_queue(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    def _free_request(self, request: Request) -> dict | None:
        """Forget a finished request (its blocks are freed now, or once its KV transfer
        ends); returns the connector's ``kv_transfer_params``."""
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        return self.kv_transfers.request_finished(request)

    def has_unfinished_requests(self) -> bool:
        """True while any request runs, waits, or holds blocks for an unfinished transfer."""
        return bool(self.requests) or self.kv_transfers.holds_blocks

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """One step's batch: running requests first (preempting when the pool is out of
        blocks), then waiting ones, unless this step had to preempt (no room to admit anyone)."""
        num_scheduled: dict[str, int] = {}
        # The running requests scheduled this step, in order, and the blocks each was given.
        scheduled_running: dict[Request, KVCacheBlocks] = {}
        budget, preempted = self._schedule_running(num_scheduled, scheduled_running)
        self.kv_transfers.cancel_overdue_loads()
        scheduled_new: list[Request] = []
        if not preempted:
            budget = self._schedule_waiting(budget, num_scheduled, scheduled_new)
        kv = self.kv_cache_manager
        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=r.request_id,
                    token_ids=list(r.all_token_ids),
                    num_prompt_tokens=r.num_prompt_tokens,
                    sampling_params=r.sampling_params,
                    block_ids=kv.get_block_ids(r.request_id),
                    num_computed_tokens=r.num_computed_tokens,
                )
                for r in scheduled_new
            ],
            scheduled_cached_reqs=[
                CachedRequestData(r.request_id, new_blocks.get_block_ids(), r.num_computed_tokens)
                for r, new_blocks in scheduled_running.items()
            ],
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
        )
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        # Tokens scheduled now count as computed: their KV is written by this step's forward.
        for request in (*scheduled_running, *scheduled_new):
            n = num_scheduled[request.request_id]
            num_prompt_left = request.num_prompt_tokens - request.num_computed_tokens
            if num_prompt_left > 0:
                self.stats.num_prompt_tokens += min(n, num_prompt_left)
            request.num_computed_tokens += n
        return output

    def _schedule_running(
        self, num_scheduled: dict[str, int], scheduled: dict[Request, KVCacheBlocks]
    ) -> tuple[int, bool]:
        """Decodes and prefill chunks in progress, preempting when out of blocks; returns the
        token budget left and whether anyone was preempted."""
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(
                request.num_tokens - request.num_computed_tokens,
                budget,
                self.max_model_len - request.num_computed_tokens,
            )
            if num_new <= 0:
                i += 1
                continue
            while (new_blocks := self.kv_cache_manager.allocate_slots(request, num_new)) is None:
                victim = self._pick_victim()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                if victim.request_id in num_scheduled:  # scheduled earlier this step (priority)
                    del scheduled[victim]
                    budget += num_scheduled.pop(victim.request_id)
                i = self.running.index(request)
            if new_blocks is None:
                continue
            scheduled[request] = new_blocks
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            i += 1
        return budget, preempted

    def _schedule_waiting(
        self, budget: int, num_scheduled: dict[str, int], scheduled: list[Request]
    ) -> int:
        """Admit waiting requests while the budget and ``max_num_seqs`` allow; returns the
        token budget left."""
        skipped: list[Request] = []
        while self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if loading and not self.kv_transfers.promote_if_loaded(request):
                skipped.append(self.waiting.pop())
                continue
            admission = self._admit(request, budget)
            if admission.outcome is AdmissionOutcome.NO_ROOM:
                break
            self.waiting.pop()
            if admission.outcome is not AdmissionOutcome.SCHEDULED:  # retry, or its KV loads
                skipped.append(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(request)
            num_scheduled[request.request_id] = admission.num_new_tokens
            budget -= admission.num_new_tokens
        for request in reversed(skipped):
            self.waiting.prepend(request)
        return budget

    def _admit(self, request: Request, budget: int) -> Admission:
        """Allocate for a waiting request: its local prefix hit and the connector's tokens on
        its first admission; what is left after its remote load once promoted."""
        kv = self.kv_cache_manager
        hit_blocks, num_hit, external = None, 0, NO_EXTERNAL_TOKENS
        first_time = not kv.is_allocated(request.request_id)
        if first_time:
            if request.sampling_params.prompt_logprobs is None:
                hit_blocks, num_hit = kv.get_computed_blocks(request)
            external = self.kv_transfers.get_external_tokens(request, num_hit)
            if external is None:
                return Admission(AdmissionOutcome.RETRY)
            num_new = request.num_tokens - num_hit - external.num_tokens
            if external.load_async:
                num_new = 0
        else:  # promoted after a remote load: its blocks are allocated, part of it computed
            num_new = request.num_tokens - request.num_computed_tokens
        if num_new > budget and not self.config.enable_chunked_prefill:
            return Admission(AdmissionOutcome.NO_ROOM)
        num_new = min(num_new, budget)
        new_blocks = kv.allocate_slots(
            request,
            num_new,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hit_blocks if num_hit else None,
            num_external_computed_tokens=external.num_tokens,
            delay_cache_blocks=external.load_async,
            full_sequence_must_fit=first_time,
        )
        if new_blocks is None:
            return Admission(AdmissionOutcome.NO_ROOM)
        if first_time:
            self.kv_transfers.on_allocated(request, external)
            kv.record_prefix_cache_stats(request, num_hit)
            request.num_computed_tokens = num_hit + external.num_tokens
            request.num_cached_tokens = num_hit + external.num_tokens
        if external.load_async:
            return Admission(AdmissionOutcome.LOADING)
        return Admission(AdmissionOutcome.SCHEDULED, num_new)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV, go back to the front of the waiting queue."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.stats.num_preemptions += 1
        self.preempted_req_ids.add(request.request_id)
        self.waiting.prepend(request)

    # ------------------------------------------------------------------ after the forward pass
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        stats = self.stats
        connector_output = runner_output.kv_connector_output
        recompute_req_ids: set[str] = set()
        if connector_output is not None and not connector_output.is_empty:
            recompute_req_ids = self._update_from_kv_transfers(connector_output, outputs)
        if not scheduler_output.is_empty:
            stats.num_steps += 1
            if runner_output.num_reqs > 1:
                stats.num_batched_steps += 1
            stats.max_batch_size = max(stats.max_batch_size, runner_output.num_reqs)
        logprobs = runner_output.logprobs
        for idx, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished or req_id in recompute_req_ids:
                continue
            new_token_ids = runner_output.sampled_token_ids[idx]
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if not new_token_ids and prompt_logprobs is None:
                continue
            if new_token_ids:
                request.append_output_token_ids(new_token_ids)
                stats.num_generation_tokens += len(new_token_ids)
                self._check_stop(request)
            params = None
            if request.is_finished:
                self.running.remove(request)
                params = self._free_request(request)
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=[logprobs[idx]] if logprobs and logprobs[idx] else None,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    kv_transfer_params=params,
                )
            )
        self._update_stats()
        return outputs

    def _update_from_kv_transfers(
        self, output: KVConnectorOutput, outputs: list[EngineCoreOutput]
    ) -> set[str]:
        """Apply ended sends and loads and bad blocks; returns running requests whose step
        must be redone because the KV it read was bad."""
        results = self.kv_transfers.update_from_output(output, self.requests.values())
        for request, reason in results.failed:
            self._fail_request(request, reason, outputs)
        for request in results.redo:
            # Back to waiting with its blocks kept; the worker drops its row (and this step's
            # token) and rebuilds it.
            self.running.remove(request)
            request.status = RequestStatus.WAITING
            self.waiting.prepend(request)
            self.preempted_req_ids.add(request.request_id)
        return {request.request_id for request in results.redo}

    def _fail_request(self, request: Request, reason: str, outputs: list[EngineCoreOutput]) -> None:
        """End a running or waiting request with an error."""
        self._remove_from_queue(request)
        request.status = RequestStatus.FINISHED_ERROR
        request.error = reason
        self._free_request(request)
        outputs.append(
            EngineCoreOutput(request.request_id, [], finish_reason="error", error=reason)
        )

    def _check_stop(self, request: Request) -> None:
        """EOS (unless ``ignore_eos``) and stop token ids, the generation config's other EOS ids
        among them, end a request (the sampler masks them until ``min_tokens``); so do
        ``max_tokens`` and the context length."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if last == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
        elif last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
        elif (
            request.num_tokens >= self.max_model_len
            or request.num_output_tokens >= request.max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED

    def _update_stats(self) -> None:
        stats, kv = self.stats, self.kv_cache_manager
        stats.num_running_reqs = len(self.running)
        stats.num_waiting_reqs = len(self.waiting)
        stats.kv_cache_usage = kv.usage
        stats.prefix_cache_queries = kv.prefix_cache_stats.queries
        stats.prefix_cache_hits = kv.prefix_cache_stats.hits

    def make_stats(self) -> SchedulerStats:
        self._update_stats()
        return self.stats
