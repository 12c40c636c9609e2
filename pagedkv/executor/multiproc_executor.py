"""MultiprocExecutor: ``tensor_parallel_size`` ranks, rank 0 in this process, the others in
worker processes (``worker_proc``), all in step.

    engine ──Execute (msgspec, written once)──> ShmBroadcast ──> rank 1 … N-1
       │                                                             │
       └── rank 0: ModelRunner.execute_model  <── collectives ──>  each rank's ModelRunner
       <──────────────── Done (its KV connector report), one pipe per rank ─┘

Rank 0 samples; the others get its tokens with the next step's ``Execute``. A rank that dies
ends the engine at once: a monitor thread sees the process exit (its pidfd), closes the group
(a rank blocked in a collective is released) and tells the engine (``on_rank_death``), whose
next or current step raises. Worker processes never outlive the engine (``worker_proc``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from pagedkv.distributed.shard import TPLayout
from pagedkv.distributed.tp_group import TPGroup, init_tp_group
from pagedkv.executor.connector_codec import decode_output, encode_plain
from pagedkv.executor.errors import RankDiedError
from pagedkv.executor.executor import Executor
from pagedkv.executor.kv_output_aggregator import KVOutputAggregator
from pagedkv.executor.messages import (
    ENCODER,
    AttachConnector,
    Command,
    Done,
    Execute,
    Failed,
    InitKVCache,
    Ready,
    Shutdown,
    WarmUp,
)
from pagedkv.executor.rank_meeting import meet_as_rank0
from pagedkv.executor.shm_broadcast import ShmBroadcast, create_segment
from pagedkv.executor.worker_handle import WorkerHandle
from pagedkv.kv_cache.kv_cache_config import KVCacheConfig
from pagedkv.kv_connector.base import KVConnectorWorker
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_transfer.factory import create_worker_connector
from pagedkv.worker.config import WorkerConfig
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.model_runner_output import ModelRunnerOutput
from pagedkv.worker.scheduler_output import GrammarBitmask, SchedulerOutput

logger = logging.getLogger(__name__)

#: A collective (and the ranks' meeting) fails after this long without its peers: a slow step
#: is never that slow, and a dead rank is seen at once by the monitor anyway.
COLLECTIVE_TIMEOUT_S = 300.0


class MultiprocExecutor(Executor):
    def __init__(self, configs: list[WorkerConfig], log_level: str = "INFO") -> None:
        """``configs[r]``: rank r's worker config (its own ``cpu_cores``)."""
        world = self.tensor_parallel_size = len(configs)
        self._dead: str | None = None
        self._on_death: list[Callable[[str], None]] = []
        self._aggregator: KVOutputAggregator | None = None
        self._sampled: tuple[list[str], list[list[int]]] = ([], [])
        self._stopped = False
        self._lock = threading.Lock()
        self.workers: list[WorkerHandle] = []
        meeting_dir = tempfile.mkdtemp(prefix="pagedkv-tp-")  # 0700: this user only
        store_path = os.path.join(meeting_dir, "store")
        self._broadcast_fd = create_segment(world - 1)
        self._broadcast = ShmBroadcast(self._broadcast_fd, world - 1)
        try:
            for rank in range(1, world):
                self.workers.append(
                    WorkerHandle(
                        rank, world, configs[rank], store_path, COLLECTIVE_TIMEOUT_S,
                        self._broadcast_fd, log_level,
                    )
                )  # fmt: skip
            self.tp: TPGroup = meet_as_rank0(
                lambda: init_tp_group(0, world, store_path, COLLECTIVE_TIMEOUT_S),
                self._check_started,
            )
            self.runner = ModelRunner(configs[0], self.tp)
            for worker in self.workers:
                self._expect(worker, Ready, "start")
        except BaseException:
            self.shutdown()
            raise
        finally:
            shutil.rmtree(meeting_dir, ignore_errors=True)
        self._monitor = threading.Thread(target=self._watch, name="pagedkv-tp-monitor", daemon=True)
        self._monitor.start()
        logger.info("tensor parallelism: %d ranks (rank 0 in this process)", world)

    # ------------------------------------------------------------------ health
    def on_rank_death(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(why)`` (from the monitor thread) once a rank has died."""
        self._on_death.append(callback)

    def check_health(self) -> None:
        if self._dead is not None:
            raise RankDiedError(self._dead)

    def _check_started(self) -> None:
        """During start-up: raise, naming the rank, once one has failed or exited."""
        for worker in self.workers:
            reason = worker.exit_reason()
            if reason is not None:
                raise RankDiedError(
                    f"{worker.name} failed to start: {self._last_words(worker, reason)}"
                )

    def _last_words(self, worker: WorkerHandle, reason: str) -> str:
        """The rank's ``Failed`` message if it sent one, else how its process ended."""
        try:
            reply = worker.replies.receive()
        except (EOFError, OSError, ValueError):
            return reason
        return reply.error if isinstance(reply, Failed) else reason

    def _watch(self) -> None:
        """The monitor thread: waits for any worker process to exit while the engine runs."""
        pidfds = {worker.pidfd: worker for worker in self.workers}
        while not self._stopped:
            ready, _, _ = select.select(list(pidfds), [], [], 1.0)
            if not ready or self._stopped:
                continue
            worker = pidfds[ready[0]]
            worker.proc.wait()
            self._die(f"{worker.name} died ({worker.exit_reason()})")
            return

    def _die(self, why: str) -> None:
        with self._lock:  # not while ``shutdown`` unmaps the group
            if self._dead is not None or self._stopped:
                return
            self._dead = why
            logger.error("%s: the engine stops", why)
            self.tp.abort()
            self._broadcast.close()
        for callback in self._on_death:
            callback(why)

    # ------------------------------------------------------------------ commands
    def _expect(self, worker: WorkerHandle, kind: type, what: str):
        """Worker's next reply, which must be ``kind``; RankDiedError naming the rank if it
        failed or exited instead."""
        try:
            reply = worker.replies.receive()
        except EOFError:
            worker.proc.wait()
            why = f"{worker.name} died during {what} ({worker.exit_reason()})"
            raise RankDiedError(why) from None
        if isinstance(reply, Failed):
            raise RankDiedError(f"{worker.name} failed during {what}: {reply.error}")
        assert isinstance(reply, kind), reply
        return reply

    def _send(self, command: Command) -> None:
        self.check_health()
        self._broadcast.publish(
            ENCODER.encode(command), [w.wake_fd for w in self.workers], self.check_health
        )

    def _collect(self, what: str) -> list[Done]:
        try:
            return [self._expect(worker, Done, what) for worker in self.workers]
        except RankDiedError as e:
            self._die(str(e))
            raise

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self._send(InitKVCache(kv_cache_config.num_blocks, block_size))
        self.runner.initialize_kv_cache(kv_cache_config)
        self._collect("KV cache allocation")
        self._send(WarmUp())
        self.runner.warm_up()
        self._collect("warm-up")

    def attach_kv_connector(
        self,
        config: KVTransferConfig,
        model_fingerprint: str,
        combine_worker_meta: Callable[[list[Any]], Any],
    ) -> KVConnectorWorker:
        num_kv_heads = self.runner.model_config.num_key_value_heads
        fields = msgspec.to_builtins(config)
        self._send(AttachConnector(fields, model_fingerprint, num_kv_heads))
        layout = TPLayout(0, self.tensor_parallel_size, num_kv_heads)
        connector = create_worker_connector(
            config, self.runner.kv_cache_config, model_fingerprint, layout
        )
        self.runner.set_kv_connector(connector)
        self._collect("KV connector start")
        self._aggregator = KVOutputAggregator(self.tensor_parallel_size, combine_worker_meta)
        return connector

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None
    ) -> ModelRunnerOutput:
        sampled_req_ids, sampled_token_ids = self._sampled
        command = Execute(
            dataclasses.replace(scheduler_output, kv_connector_metadata=None),
            encode_plain(scheduler_output.kv_connector_metadata),
            sampled_req_ids,
            sampled_token_ids,
        )
        if grammar_bitmask is not None:
            command.grammar_req_ids = grammar_bitmask.req_ids
            command.grammar_bitmask = grammar_bitmask.bitmask.tobytes()
            command.grammar_shape = grammar_bitmask.bitmask.shape
        self._send(command)
        try:
            output = self.runner.execute_model(scheduler_output, grammar_bitmask)
        except Exception as e:
            self.check_health()  # a rank's death explains a failed collective
            raise RuntimeError(f"tensor-parallel rank 0 failed: {e}") from e
        replies = self._collect("a step")
        kept = [(r, t) for r, t in zip(output.req_ids, output.sampled_token_ids) if t]
        self._sampled = ([r for r, _ in kept], [t for _, t in kept])
        if self._aggregator is not None:
            outputs = [output.kv_connector_output]
            outputs += [decode_output(reply.kv_connector_output) for reply in replies]
            output.kv_connector_output = self._aggregator.aggregate(outputs)
        return output

    def shutdown(self) -> None:
        """Tell every rank to stop and wait for them (killing one that does not stop)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self._dead is None and self.workers:
            with contextlib.suppress(OSError):
                self._broadcast.publish(
                    ENCODER.encode(Shutdown()), [w.wake_fd for w in self.workers], lambda: None
                )
        self._broadcast.close()
        for worker in self.workers:
            worker.stop()
        if hasattr(self, "tp"):
            with self._lock:
                self.tp.close()
        os.close(self._broadcast_fd)
