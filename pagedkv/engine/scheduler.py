"""Scheduler, vLLM V1 style: no prefill or decode phases.

Every step each request advances ``num_computed_tokens`` toward ``num_tokens`` under a token
budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). A prompt longer than
the remaining budget is chunked over several steps; a prefix-cache hit (or KV loaded by a
connector) starts it further along. Running requests go first; when the pool is out of blocks,
the newest running request (or the lowest-priority one) is preempted by recompute: its blocks are
freed and it waits again.

With a KV connector, a request whose KV arrives from elsewhere waits in
``WAITING_FOR_REMOTE_KVS`` (blocks allocated, nothing computed) until the connector reports its
load finished, or until its deadline, when the load is cancelled and counts as failed. A
finished request whose blocks a connector still sends from is held in ``sending`` until the
connector reports the send finished (delivered, refused or lease expired).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pagedkv.engine.config import SchedulerConfig
from pagedkv.engine.outputs import EngineCoreOutput
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.request_queue import create_request_queue
from pagedkv.engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedkv.engine.scheduler_stats import SchedulerStats
from pagedkv.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pagedkv.kv_transfer.base import KVConnectorBase
from pagedkv.worker.model_runner_output import KVConnectorOutput, ModelRunnerOutput


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
        #: Finished requests whose blocks the connector still sends from.
        self.sending: dict[str, Request] = {}
        #: Requests that ended while their KV was still arriving: freed once the load ends.
        self.ended_while_loading: dict[str, Request] = {}
        #: Loads that ended (reported by the connector) but whose request is not promoted yet.
        self.finished_loads: set[str] = set()
        #: Requests whose load failed under the "fail" policy, with the reason.
        self.failed_loads: dict[str, str] = {}
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
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            # A load that already ended (reported, not yet promoted) has nothing to cancel.
            loading = (
                request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and request_id not in self.finished_loads
            )
            request.status = status
            if loading and self.connector is not None:
                self.connector.cancel_load(request)
            self._free_request(request, still_loading=loading)

    def _free_request(self, request: Request, still_loading: bool = False) -> dict | None:
        """Forget a finished request; returns the connector's ``kv_transfer_params``."""
        request_id = request.request_id
        del self.requests[request_id]
        self.finished_req_ids.add(request_id)
        self.finished_loads.discard(request_id)
        self.failed_loads.pop(request_id, None)
        kv = self.kv_cache_manager
        hold, params = False, None
        if self.connector is not None:
            hold, params = self.connector.request_finished(request, kv.get_block_ids(request_id))
        if not kv.is_allocated(request_id):
            return params
        if still_loading:
            self.ended_while_loading[request_id] = request
        elif hold:
            self.sending[request_id] = request
        else:
            kv.free(request)
        return params

    def has_unfinished_requests(self) -> bool:
        """True while any request runs, waits, or holds blocks for an unfinished transfer."""
        return bool(self.requests or self.sending or self.ended_while_loading)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks_of: dict[str, KVCacheBlocks] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        preempted = False

        # 1. Running requests: decodes and prefill chunks in progress.
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
            while (new_blocks := kv.allocate_slots(request, num_new)) is None:
                victim = self._pick_victim()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                if victim.request_id in num_scheduled:  # scheduled earlier this step (priority)
                    scheduled_running.remove(victim)
                    del new_blocks_of[victim.request_id]
                    budget += num_scheduled.pop(victim.request_id)
                i = self.running.index(request)
            if new_blocks is None:
                continue
            scheduled_running.append(request)
            new_blocks_of[request.request_id] = new_blocks
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            i += 1

        # 2. Waiting requests, unless this step had to preempt (no room to admit anyone).
        self._cancel_overdue_loads()
        skipped: list[Request] = []
        while not preempted and self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if loading and not self._promote_if_loaded(request):
                skipped.append(self.waiting.pop())
                continue
            admission = self._admit(request, budget)
            if admission is None:
                break
            if admission == "skip":
                skipped.append(self.waiting.pop())
                continue
            num_new = admission
            self.waiting.pop()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled_new.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        for request in reversed(skipped):
            self.waiting.prepend(request)

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
                CachedRequestData(
                    r.request_id,
                    new_blocks_of[r.request_id].get_block_ids(),
                    r.num_computed_tokens,
                )
                for r in scheduled_running
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

    def _admit(self, request: Request, budget: int) -> int | str | None:
        """Allocate for a waiting request. Returns the tokens to compute this step, "skip" to
        look again next step, or None when it does not fit (admission stops)."""
        kv = self.kv_cache_manager
        hit_blocks, num_hit, num_external, load_async = None, 0, 0, False
        first_time = not kv.is_allocated(request.request_id)
        if first_time:
            if request.sampling_params.prompt_logprobs is None:
                hit_blocks, num_hit = kv.get_computed_blocks(request)
            if self.connector is not None:
                num_external, load_async = self.connector.get_num_new_matched_tokens(
                    request, num_hit
                )
                if num_external is None:
                    return "skip"
                load_async = load_async and num_external > 0
                if not load_async:  # the last prompt token is computed here, for its logits
                    num_external = min(num_external, request.num_tokens - 1 - num_hit)
            num_new = 0 if load_async else request.num_tokens - num_hit - num_external
        else:  # promoted after a remote load: its blocks are allocated, part of it computed
            num_new = request.num_tokens - request.num_computed_tokens
        if num_new > budget and not self.config.enable_chunked_prefill:
            return None
        num_new = min(num_new, budget)
        new_blocks = kv.allocate_slots(
            request,
            num_new,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hit_blocks if num_hit else None,
            num_external_computed_tokens=num_external,
            delay_cache_blocks=load_async,
            full_sequence_must_fit=first_time,
        )
        if new_blocks is None:
            return None
        if first_time:
            if self.connector is not None:
                self.connector.update_state_after_alloc(
                    request, kv.get_blocks(request.request_id), num_external
                )
            kv.record_prefix_cache_stats(request, num_hit)
            request.num_computed_tokens = num_hit + num_external
            request.num_cached_tokens = num_hit + num_external
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.kv_load_deadline = time.monotonic() + self._kv_load_timeout
            request.kv_load_cancelled = False
        return num_new

    @property
    def _kv_load_timeout(self) -> float:
        assert self.connector is not None
        return self.connector.config.kv_load_timeout

    def _promote_if_loaded(self, request: Request) -> bool:
        """True once the request's remote load has ended: it then computes what is missing
        (at least the last prompt token, whose logits give the first output token)."""
        request_id = request.request_id
        if request_id not in self.finished_loads:
            return False
        self.finished_loads.discard(request_id)
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        request.num_cached_tokens = request.num_computed_tokens
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING
        return True

    def _cancel_overdue_loads(self) -> None:
        """A load past its deadline is cancelled; the connector then ends it as failed."""
        if self.connector is None:
            return
        now = time.monotonic()
        for request in self.waiting:
            if (
                request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and now > request.kv_load_deadline
                and not request.kv_load_cancelled
            ):
                request.kv_load_cancelled = True
                self.connector.cancel_load(request)

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
        """Apply finished sends and loads and failed blocks; returns running requests whose
        step must be redone because their synchronously loaded KV was bad."""
        kv = self.kv_cache_manager
        if self.connector is not None:
            self.connector.update_connector_output(output)
        for request_id in output.finished_sending:
            request = self.sending.pop(request_id, None)
            if request is not None:
                kv.free(request)
        recompute = self._handle_invalid_blocks(
            output.invalid_block_ids, outputs, output.load_errors
        )
        for request_id in output.finished_recving:
            ended = self.ended_while_loading.pop(request_id, None)
            if ended is not None:
                kv.free(ended)
                continue
            request = self.requests.get(request_id)
            if request is None:
                continue
            reason = self.failed_loads.pop(request_id, None)
            if reason is not None:
                self.waiting.remove(request)
                self._fail_request(request, reason, outputs)
            else:
                self.finished_loads.add(request_id)
        return recompute

    def _handle_invalid_blocks(
        self,
        invalid_block_ids: set[int],
        outputs: list[EngineCoreOutput],
        load_errors: dict[str, str],
    ) -> set[str]:
        """A failed load is a set of block ids. Under the "recompute" policy the affected
        request keeps the KV before the first bad block and computes the rest itself; under
        "fail" it ends with an error. Bad blocks never stay in the prefix cache."""
        if not invalid_block_ids:
            return set()
        kv = self.kv_cache_manager
        policy = self.connector.load_failure_policy  # type: ignore[union-attr]
        kv.evict_blocks(b for b in invalid_block_ids if 0 < b < kv.block_pool.num_blocks)
        recompute: set[str] = set()
        for request in list(self.requests.values()):
            first_bad = self._first_invalid_token(request, invalid_block_ids)
            if first_bad is None:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if policy == "fail":
                    why = load_errors.get(request.request_id)
                    self.failed_loads[request.request_id] = (
                        f"loading the KV cache of request {request.request_id!r} from a remote "
                        "instance failed (kv_load_failure_policy=fail)"
                        + (f": {why}" if why else "")
                    )
                else:
                    request.num_computed_tokens = min(request.num_computed_tokens, first_bad)
            elif request.status == RequestStatus.RUNNING:
                # This step's tokens attended to the bad KV: nothing from the first bad block on
                # may be hit by another request.
                kv.evict_blocks(self._block_ids_from(request, first_bad))
                if policy == "fail":
                    self.running.remove(request)
                    self._fail_request(
                        request,
                        "loading the KV cache failed (kv_load_failure_policy=fail)",
                        outputs,
                    )
                else:
                    # Redo from the first bad block: back to waiting with its blocks kept;
                    # the worker drops its row (and this step's token) and rebuilds it.
                    self.running.remove(request)
                    request.num_computed_tokens = min(request.num_computed_tokens, first_bad)
                    request.status = RequestStatus.WAITING
                    self.waiting.prepend(request)
                    self.preempted_req_ids.add(request.request_id)
                    recompute.add(request.request_id)
        return recompute

    def _fail_request(self, request: Request, reason: str, outputs: list[EngineCoreOutput]) -> None:
        """End a request (already off the running and waiting queues) with an error."""
        request.status = RequestStatus.FINISHED_ERROR
        request.error = reason
        self._free_request(request)
        outputs.append(
            EngineCoreOutput(request.request_id, [], finish_reason="error", error=reason)
        )

    def _block_ids_from(self, request: Request, first_token: int) -> set[int]:
        out: set[int] = set()
        groups = self.kv_cache_manager.kv_cache_config.kv_cache_groups
        for group, block_ids in zip(
            groups, self.kv_cache_manager.get_block_ids(request.request_id)
        ):
            out.update(block_ids[first_token // group.kv_cache_spec.block_size :])
        out.discard(0)  # the null block is never cached
        return out

    def _first_invalid_token(self, request: Request, invalid: set[int]) -> int | None:
        first = None
        groups = self.kv_cache_manager.kv_cache_config.kv_cache_groups
        for group, block_ids in zip(
            groups, self.kv_cache_manager.get_block_ids(request.request_id)
        ):
            for i, block_id in enumerate(block_ids):
                if block_id in invalid:
                    token = i * group.kv_cache_spec.block_size
                    first = token if first is None else min(first, token)
                    break
        return first

    def _check_stop(self, request: Request) -> None:
        """EOS and stop token ids end a request (the sampler masks them until ``min_tokens``);
        so do ``max_tokens`` and the context length."""
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
