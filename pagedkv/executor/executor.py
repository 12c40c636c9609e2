"""Executor: what the engine calls to run the model, on one rank or on several.

The engine keeps ``runner`` (rank 0's ``ModelRunner``, in this process) for the model's facts
(config, limits, KV cache specs, generation defaults) and goes through the executor for what
every rank does in step: allocating the KV cache and warming up, attaching a KV connector, each
step, shutting down. ``UniProcExecutor`` is one rank, as the engine always ran;
``MultiprocExecutor`` drives ``tensor_parallel_size`` ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pagedkv.distributed.shard import SINGLE_LAYOUT
from pagedkv.kv_cache.kv_cache_config import KVCacheConfig
from pagedkv.kv_connector.base import KVConnectorWorker
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_transfer.factory import create_worker_connector
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.model_runner_output import ModelRunnerOutput
from pagedkv.worker.scheduler_output import GrammarBitmask, SchedulerOutput


class Executor(ABC):
    #: Rank 0's runner, in this process.
    runner: ModelRunner
    tensor_parallel_size = 1

    @abstractmethod
    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate every rank's KV cache (its own heads, the same block ids) and warm up."""

    @abstractmethod
    def attach_kv_connector(
        self,
        config: KVTransferConfig,
        model_fingerprint: str,
        combine_worker_meta: Callable[[list[Any]], Any],
    ) -> KVConnectorWorker:
        """Give every rank its worker half of the connector; returns rank 0's.
        ``combine_worker_meta``: the connector's rule for one ``worker_meta`` of the ranks'."""

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None
    ) -> ModelRunnerOutput:
        """One step on every rank: rank 0's tokens, and the ranks' KV connector report."""

    def on_rank_death(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(why)`` once a rank has died (never, with one rank: it is this
        process)."""
        return None

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank (idempotent). The connector halves are shut down by their owner."""


class UniProcExecutor(Executor):
    """One rank, in this process."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.runner.initialize_kv_cache(kv_cache_config)
        self.runner.warm_up()

    def attach_kv_connector(
        self,
        config: KVTransferConfig,
        model_fingerprint: str,
        combine_worker_meta: Callable[[list[Any]], Any],
    ) -> KVConnectorWorker:
        connector = create_worker_connector(
            config, self.runner.kv_cache_config, model_fingerprint, SINGLE_LAYOUT
        )
        self.runner.set_kv_connector(connector)
        return connector

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None
    ) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output, grammar_bitmask)

    def shutdown(self) -> None:
        """Nothing to stop: the one rank is this process."""
        return None
