"""Scheduler, vLLM V1 style: no prefill or decode phases.

Every step each request advances ``num_computed_tokens`` toward ``num_tokens`` under a token
budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). A prompt longer than
the remaining budget is chunked over several steps; a prefix-cache hit starts it further along.
Running requests go first; when the pool is out of blocks, the newest running request (or the
lowest-priority one) is preempted by recompute: its blocks are freed and it waits again.
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
from pagedkv.worker.model_runner_output import ModelRunnerOutput


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = scheduler_config.max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        #: Requests the worker must forget (or, if preempted, unbatch) at the next step.
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step loop (abort, stop string): free their blocks now."""
        assert status.is_finished
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        if self.kv_cache_manager.is_allocated(request.request_id):
            self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

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
        while not preempted and self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            hit_blocks, num_hit = None, 0
            if request.sampling_params.prompt_logprobs is None:
                hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            new_blocks = kv.allocate_slots(
                request,
                num_new,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=hit_blocks if num_hit else None,
                full_sequence_must_fit=True,
            )
            if new_blocks is None:
                break
            self.waiting.pop()
            kv.record_prefix_cache_stats(request, num_hit)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            request.num_cached_tokens = num_hit
            self.running.append(request)
            scheduled_new.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=r.request_id,
                    token_ids=list(r.all_token_ids),
                    num_prompt_tokens=r.num_prompt_tokens,
                    num_output_tokens=r.num_output_tokens,
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
        # Tokens scheduled now count as computed: their KV is written by this step's forward.
        now = time.monotonic()
        for request in (*scheduled_running, *scheduled_new):
            n = num_scheduled[request.request_id]
            num_prompt_left = request.num_prompt_tokens - request.num_computed_tokens
            if num_prompt_left > 0:
                self.stats.num_prompt_tokens += min(n, num_prompt_left)
            request.num_computed_tokens += n
        for request in scheduled_new:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        return output

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
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.preempted_req_ids.add(request.request_id)
        self.waiting.prepend(request)

    # ------------------------------------------------------------------ after the forward pass
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        stats = self.stats
        stats.num_steps += 1
        if runner_output.num_reqs > 1:
            stats.num_batched_steps += 1
        stats.max_batch_size = max(stats.max_batch_size, runner_output.num_reqs)
        logprobs = runner_output.logprobs
        for idx, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            new_token_ids = runner_output.sampled_token_ids[idx]
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if not new_token_ids and prompt_logprobs is None:
                continue
            if new_token_ids:
                request.append_output_token_ids(new_token_ids)
                stats.num_generation_tokens += len(new_token_ids)
                self._check_stop(request)
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=[logprobs[idx]] if logprobs and logprobs[idx] else None,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
            if request.is_finished:
                self.running.remove(request)
                self._free_request(request)
        self._update_stats()
        return outputs

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
