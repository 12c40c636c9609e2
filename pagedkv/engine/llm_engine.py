"""LLMEngine: tokenizes, schedules, runs the model and detokenizes, one step at a time.

step(): Scheduler.schedule() -> ModelRunner.execute_model() -> Scheduler.update_from_output()
        -> OutputProcessor (text, stop strings) -> RequestOutputs
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable

from pagedkv.distributed.shard import TPLayout
from pagedkv.engine.config import SchedulerConfig
from pagedkv.engine.engine_args import DEFAULT_CPU_KV_CACHE_MEMORY, EngineArgs
from pagedkv.engine.engine_description import EngineDescription, ModelIdentity
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.request_input import NewRequest, PromptType, RequestInput
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_stats import SchedulerStats
from pagedkv.engine.structured_output_manager import StructuredOutputManager
from pagedkv.executor.factory import create_executor
from pagedkv.kv_cache.block_hash import BlockHasher
from pagedkv.kv_cache.kv_cache_config import get_kv_cache_config
from pagedkv.kv_cache.kv_cache_manager import KVCacheManager
from pagedkv.kv_connector.base import KVConnectorBase
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_connector.histogram import HistogramStat
from pagedkv.kv_events.config import KVEventsConfig
from pagedkv.kv_events.publisher import KVEventPublisher
from pagedkv.kv_transfer.factory import create_scheduler_connector
from pagedkv.model.tokenizer import load_tokenizer
from pagedkv.sampling_params import SamplingParams
from pagedkv.utils import cdiv

logger = logging.getLogger(__name__)


#: Longest an idle step waits for a KV transfer to end (new requests wait at most this long).
IDLE_WAIT_S = 0.005


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        model_path = args.model_path
        self.tokenizer = load_tokenizer(args.tokenizer or model_path)
        self.executor = create_executor(args.create_worker_configs())
        #: Rank 0's runner (in this process): the model's facts; every rank runs through
        #: ``executor``.
        self.model_runner = self.executor.runner
        self.vocab_size = self.model_runner.model_config.vocab_size
        self.max_model_len = self.model_runner.max_model_len
        generation_defaults = self.model_runner.generation_defaults
        self.eos_token_id = generation_defaults.eos_token_id
        if self.eos_token_id is None and self.tokenizer is not None:
            self.eos_token_id = self.tokenizer.eos_token_id
        #: Every EOS id: each request's stop ids get them (``update_from_generation_config``).
        self.eos_token_ids = generation_defaults.eos_token_ids

        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            policy=args.scheduling_policy,
        )
        self.kv_events_config = KVEventsConfig.from_dict(args.kv_events_config or {})
        publishes = self.kv_events_config.publishes and args.enable_prefix_caching
        self._init_kv_cache(publishes)
        #: Publishes what the prefix cache stores and evicts (``--kv-events-config``).
        self.kv_event_publisher = KVEventPublisher(self.kv_events_config) if publishes else None
        dtype = str(self.model_runner.dtype).removeprefix("torch.")
        identity = ModelIdentity.of(
            model_path,
            dtype,
            self.kv_cache_config,
            args.block_size,
            self.model_runner.model_config.num_key_value_heads,
        )
        connector = self._init_kv_connector(identity.fingerprint)
        self.description = self._describe(identity, connector)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager, connector)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.eos_token_id
        )
        self._request_counter = itertools.count()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.start()
            logger.info("KV events on %s", self.kv_event_publisher.endpoint)
        logger.info(
            "pagedkv engine: %s, %d KV cache blocks of %d tokens, max_model_len %d",
            model_path,
            self.kv_cache_config.num_blocks,
            args.block_size,
            self.max_model_len,
        )

    def _describe(
        self, identity: ModelIdentity, connector: KVConnectorBase | None
    ) -> EngineDescription:
        publisher, caching = self.kv_event_publisher, self.block_hasher is not None
        return EngineDescription(
            model_path=self.args.model_path,
            max_model_len=self.max_model_len,
            identity=identity,
            hash_algo=self.args.prefix_caching_hash_algo if caching else "",
            hash_block_size=self.kv_cache_config.hash_block_size if caching else 0,
            num_kv_cache_groups=len(self.kv_cache_config.kv_cache_groups),
            kv_events_endpoint=publisher.endpoint if publisher else "",
            kv_events_replay_endpoint=(publisher.replay_endpoint or "") if publisher else "",
            kv_events_topic=self.kv_events_config.topic,
            kv_role=self.kv_transfer_config.kv_role if self.kv_transfer_config else None,
            kv_peer=connector.peer_address if connector else None,
            kv_tiers=connector.tier_capacities() if connector else {},
            tensor_parallel_size=self.args.tensor_parallel_size,
        )

    def load(self) -> tuple[int, int]:
        """Requests running and waiting now (plain ints the engine thread writes)."""
        return self.scheduler.stats.num_running_reqs, self.scheduler.stats.num_waiting_reqs

    def kv_paths(self) -> dict[str, str]:
        """Peer engine id -> the path KV takes with it (the worker half's ``kv_paths``)."""
        connector = self.model_runner.kv_connector
        return connector.kv_paths() if connector is not None else {}

    def _init_kv_cache(self, enable_kv_cache_events: bool) -> None:
        """Size the KV cache and make its manager (refusing a cache that cannot hold a request
        of ``max_model_len`` tokens) and block hasher; allocate it in the model runner and warm
        the runner up."""
        args = self.args
        layer_specs = self.model_runner.get_kv_cache_specs(args.block_size)
        self.kv_cache_config = get_kv_cache_config(
            layer_specs,
            kv_cache_memory_bytes=self._kv_cache_budget(layer_specs),
            num_gpu_blocks_override=args.num_gpu_blocks_override,
        )
        self.kv_cache_manager = KVCacheManager(
            self.kv_cache_config,
            self.max_model_len,
            enable_caching=args.enable_prefix_caching,
            max_in_flight_tokens=args.max_num_batched_tokens,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        self.kv_cache_manager.check_one_request_fits()
        self.block_hasher = (
            BlockHasher(self.kv_cache_config.hash_block_size, args.prefix_caching_hash_algo)
            if args.enable_prefix_caching
            else None
        )
        self.executor.initialize_kv_cache(self.kv_cache_config)

    def _init_kv_connector(self, model_fingerprint: str) -> KVConnectorBase | None:
        """The KV connector's scheduler half (``--kv-transfer-config``, ``--kv-offloading-size``
        or both: ``EngineArgs.effective_kv_transfer_config``); its worker half goes to the
        model runner."""
        self.kv_transfer_config = None
        config = self.args.effective_kv_transfer_config()
        if config is None:
            return None
        self.kv_transfer_config = KVTransferConfig.from_dict(config)
        heads = self.model_runner.model_config.num_key_value_heads  # the checkpoint's
        tp = TPLayout(0, self.executor.tensor_parallel_size, heads)  # the instance's (rank 0's)
        connector = create_scheduler_connector(
            self.kv_transfer_config, self.kv_cache_config, model_fingerprint, tp
        )
        try:
            self.executor.attach_kv_connector(
                self.kv_transfer_config, model_fingerprint, connector.combine_worker_meta
            )
        except BaseException:
            connector.shutdown()
            raise
        return connector

    def _kv_cache_budget(self, layer_specs) -> int:
        """Bytes for the KV cache: the configured budget, capped at what max_num_seqs full-length
        requests could ever use (no point reserving more)."""
        budget = self.model_runner.default_kv_cache_memory()
        if self.args.kv_cache_memory is not None:
            budget = self.args.kv_cache_memory
        elif budget is None:
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
        page_bytes = sum(spec.page_size_bytes for spec in layer_specs.values())
        max_useful_blocks = self.args.max_num_seqs * cdiv(self.max_model_len, self.args.block_size)
        return min(budget, (max_useful_blocks + 1) * page_bytes)

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        return f"req-{next(self._request_counter)}"

    def default_sampling_params(self) -> SamplingParams:
        """What a request samples with when it sets nothing: the model's generation config
        (``--generation-config auto``) over vLLM's defaults."""
        return SamplingParams(**self.model_runner.generation_defaults.sampling)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids instead")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def add_request(self, request: RequestInput) -> str:
        """Validate and enqueue a request; returns its id. Bad input raises ValueError."""
        new = self.make_request(request)
        self.enqueue_request(new)
        return new.request_id

    def make_request(self, request: RequestInput) -> NewRequest:
        """Tokenize, validate and compile its grammar, without touching engine state.

        ``params.n > 1`` makes ``n`` child requests ``{i}_{request_id}`` (vLLM's ids), child
        ``i`` seeded with ``seed + i``. Safe to call from another thread than the one stepping
        the engine (AsyncLLM does).
        """
        params = request.params or self.default_sampling_params()
        request_id = request.request_id or self.new_request_id()
        text, token_ids = self.tokenize(request.prompt)
        self.validate_prompt(token_ids)
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be below the vocabulary size {self.vocab_size}, "
                f"got {params.stop_token_ids[:5]}"
            )
        room = self.max_model_len - len(token_ids)
        if request.max_tokens_must_fit and (params.max_tokens or 0) > room:
            raise ValueError(
                f"max_tokens is too large: {params.max_tokens}. This model's maximum context "
                f"length is {self.max_model_len} tokens and your request has {len(token_ids)} "
                f"input tokens ({params.max_tokens} > {self.max_model_len} - {len(token_ids)})"
            )
        max_tokens = room if params.max_tokens is None else min(room, params.max_tokens)
        children = []
        for index in range(params.n):
            changes = {}
            if params.n > 1:
                changes = dict(n=1, seed=None if params.seed is None else params.seed + index)
            # Each request's own copy: the EOS ids join its stop ids, not the caller's params.
            child_params = dataclasses.replace(params, **changes)
            child_params.update_from_generation_config(self.eos_token_ids, self.eos_token_id)
            grammar = None
            if params.structured_outputs is not None:
                grammar = self.structured_outputs.grammar_for(params.structured_outputs)
            children.append(
                Request(
                    request_id if params.n == 1 else f"{index}_{request_id}",
                    token_ids,
                    child_params,
                    max_tokens=max_tokens,
                    eos_token_id=self.eos_token_id,
                    block_hasher=self.block_hasher,
                    arrival_time=request.arrival_time,
                    priority=request.priority,
                    cache_salt=request.cache_salt,
                    kv_transfer_params=request.kv_transfer_params,
                    grammar=grammar,
                )
            )
        return NewRequest(request_id, text, children)

    def enqueue_request(self, new: NewRequest) -> None:
        """Hand a request from ``make_request`` to the scheduler (ValueError if its id is taken)."""
        if new.request_id in self.output_processor.parents:
            raise ValueError(f"request id {new.request_id!r} is already in use")
        added = []
        try:
            for child in new.children:
                self.scheduler.add_request(child)
                added.append(child.request_id)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.output_processor.add_request(new.request_id, new.prompt_text, new.children)

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                "it must be shorter, to leave room for at least one generated token"
            )
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}"
            )

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests, freeing their blocks at once; returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            child_ids = self.output_processor.child_ids(request_id)
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            output = self.output_processor.abort_request(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        scheduler = self.scheduler
        scheduler_output = scheduler.schedule()
        grammar_bitmask, scheduled = None, {}
        if self.structured_outputs.in_use:
            scheduled = {r: scheduler.requests[r] for r in scheduler_output.num_scheduled_tokens}
            grammar_bitmask = self.structured_outputs.grammar_bitmask(list(scheduled.values()))
        runner_output = self.executor.execute_model(scheduler_output, grammar_bitmask)
        core_outputs = scheduler.update_from_output(scheduler_output, runner_output)
        completed = self.structured_outputs.accept_tokens(core_outputs, scheduled)
        for core in core_outputs:  # a complete grammar ends its request, as a stop string does
            if core.request_id in completed:
                core.finish_reason = "stop"
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped or completed:
            scheduler.finish_requests(stopped + completed, RequestStatus.FINISHED_STOPPED)
        self.publish_kv_events()
        if scheduler_output.is_empty and not core_outputs:
            self._wait_for_transfers()
        return outputs

    def publish_kv_events(self) -> None:
        """Hand the step's KV events to the publisher (a bounded queue: never waits): the
        pool's, then the connector tiers' (each with its ``medium``), in one batch; and the
        pool's and the tiers' hashes when a subscriber asked for a snapshot. The connector's
        events are taken every step, published or not, so none pile up."""
        connector = self.scheduler.connector
        tier_events = connector.take_events() if connector is not None else []
        publisher = self.kv_event_publisher
        if publisher is None:
            return
        manager = self.kv_cache_manager
        publisher.publish_step(
            manager.take_events() + tier_events,
            manager.cached_block_hashes,
            connector.tier_block_hashes if connector is not None else dict,
        )

    def _wait_for_transfers(self) -> None:
        """Nothing to compute: only KV transfers are pending. Wait for one to end rather than
        spin (on a shared machine a spinning decode instance slows its prefill peer)."""
        connector = self.model_runner.kv_connector
        if connector is not None:
            connector.wait_for_progress(IDLE_WAIT_S)
        else:
            time.sleep(0.001)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        reset = self.kv_cache_manager.reset_prefix_cache()
        self.publish_kv_events()
        return reset

    def get_kv_connector_stats(self) -> dict[str, int | float | HistogramStat]:
        """Both halves' KV connector counters (exported as ``pagedkv:kv_transfer_*``). Read
        from any thread: each counter is a plain number with one writer."""
        stats: dict[str, int | float | HistogramStat] = {}
        for half in (self.scheduler.connector, self.model_runner.kv_connector):
            if half is not None:
                stats.update(half.get_kv_connector_stats())
        return stats

    def shutdown(self) -> None:
        """Stop the KV connector's and the KV event publisher's threads and sockets, then
        every tensor-parallel rank (idempotent)."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
        if self.model_runner.kv_connector is not None:
            self.model_runner.kv_connector.shutdown()
        self.executor.shutdown()
