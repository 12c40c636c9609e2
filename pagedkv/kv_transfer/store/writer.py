"""BlockWriter: stores snapshotted blocks from a background thread, never blocking the engine.

The engine thread hands over ``PutJob`` snapshots (already copied out of the paged cache). The
queue is bounded in bytes: when a job does not fit, the caller drops it (and counts it) instead
of waiting. A job names blocks by their block keys; what it puts are the values of the heads
this rank writes (``HeadLayout``). The writer skips blocks whose values are all in the store
(one ``exists_many`` per batch), encodes the rest into one reused buffer and writes them with
one ``put_from`` (rows of that buffer). ``recent_keys`` and ``on_stored`` speak of block keys:
a block is stored (by this rank) once every value it writes for it is.

A finished request whose blocks were held (``await_flush``) is reported by ``take_flushed``
once every job it had queued has ended (stored, skipped or failed), or at its deadline.
``on_stored`` (optional) hears each batch's outcome: its block keys, and whether they are now in
the store. ``submit_delete`` queues blocks to delete behind the puts already queued.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.kv_transfer.store.backends.base import StoreBackend, StoreError
from pagedkv.kv_transfer.store.block_codec import ValueBatch
from pagedkv.kv_transfer.store.head_layout import HeadLayout
from pagedkv.kv_transfer.store.recent_keys import RecentKeys
from pagedkv.kv_transfer.store.stats import StoreStats
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)
_failures = RateLimitedLog(logger)

#: Blocks per ``put_from`` call; the writer encodes them into one reused buffer.
PUT_BATCH_BLOCKS = 32


@dataclass(slots=True)
class PutJob:
    layout: HeadLayout
    #: Block keys.
    keys: list[str]
    #: Requests whose blocks are in this job (each waits for it before its flush ends).
    req_ids: set[str]
    #: ``layout.snapshot(...)`` of the blocks, in ``keys`` order.
    snapshot: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.layout.write_bytes


@dataclass(slots=True)
class DeleteJob:
    #: Block keys, and the value keys to delete (this rank's heads of those blocks).
    keys: list[str]
    value_keys: list[str]


class BlockWriter:
    def __init__(
        self,
        backend: StoreBackend,
        stats: StoreStats,
        recent_keys: RecentKeys,
        max_queued_bytes: int,
        on_stored: Callable[[list[str], bool], None] | None = None,
        background: bool = False,
    ) -> None:
        self.backend = backend
        self.on_stored = on_stored
        #: Run at the lowest CPU priority (nice 19): the writer then takes the cycles the
        #: engine leaves idle, and when there are none it falls behind and stores are dropped,
        #: instead of slowing every step (a cache's stores, not a handoff someone waits for).
        self.background = background
        self.stats = stats
        self.recent_keys = recent_keys
        self.max_queued_bytes = max_queued_bytes
        self._lock = threading.Lock()
        self._queued_bytes = 0
        #: Jobs queued or in progress, per request.
        self._num_jobs: dict[str, int] = {}
        #: Finished requests waiting for their jobs: request id -> deadline (monotonic).
        self._flush_deadlines: dict[str, float] = {}
        self._buffer: np.ndarray | None = None
        self._queue: queue.SimpleQueue[PutJob | DeleteJob | threading.Event | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="pagedkv-store-writer", daemon=True)
        self._thread.start()

    def has_room(self, nbytes: int) -> bool:
        with self._lock:
            return self._queued_bytes + nbytes <= self.max_queued_bytes

    def submit(self, job: PutJob) -> None:
        with self._lock:
            self._queued_bytes += job.nbytes
            for req_id in job.req_ids:
                self._num_jobs[req_id] = self._num_jobs.get(req_id, 0) + 1
        self._queue.put(job)

    def submit_delete(self, keys: list[str], value_keys: list[str]) -> None:
        """Delete ``value_keys`` (the values this rank wrote of blocks ``keys``)."""
        self._queue.put(DeleteJob(keys, value_keys))

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every job queued before this call has ended; False on timeout."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def await_flush(self, req_id: str, timeout_s: float) -> None:
        with self._lock:
            self._flush_deadlines[req_id] = time.monotonic() + timeout_s

    def take_flushed(self) -> set[str]:
        """Requests whose puts have all ended (or whose flush deadline passed)."""
        now = time.monotonic()
        with self._lock:
            done = {
                req_id
                for req_id, deadline in self._flush_deadlines.items()
                if req_id not in self._num_jobs or now >= deadline
            }
            for req_id in done:
                del self._flush_deadlines[req_id]
        return done

    def close(self, timeout_s: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        if self.background:
            with contextlib.suppress(OSError):  # best effort (no per-thread nice: runs as is)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while (job := self._queue.get()) is not None:
            if isinstance(job, threading.Event):
                job.set()
                continue
            if isinstance(job, DeleteJob):
                self._delete(job)
                continue
            try:
                self.store(job)
            except Exception:  # a bug here must not kill the thread and strand held blocks
                logger.exception("store writer: unexpected error")
                if self.on_stored is not None:  # the keys not reported yet end as not stored
                    self.on_stored(job.keys, False)
            finally:
                with self._lock:
                    self._queued_bytes -= job.nbytes
                    for req_id in job.req_ids:
                        left = self._num_jobs[req_id] - 1
                        if left:
                            self._num_jobs[req_id] = left
                        else:
                            del self._num_jobs[req_id]

    def store(self, job: PutJob) -> None:
        """Store one job now, on the calling thread (the writer thread calls this)."""
        snapshot = [layer_blocks.cpu() for layer_blocks in job.snapshot]
        for start in range(0, len(job.keys), PUT_BATCH_BLOCKS):
            end = min(start + PUT_BATCH_BLOCKS, len(job.keys))
            self._store_rows(job.layout, job.keys, snapshot, start, end)

    def _store_rows(
        self, layout: HeadLayout, all_keys: list[str], snapshot: list, start: int, end: int
    ) -> None:
        """Store blocks ``[start, end)`` of a job, except those whose values are all stored."""
        stats = self.stats
        keys = all_keys[start:end]
        try:
            todo = [start + i for i, stored in enumerate(self._stored(layout, keys)) if not stored]
            stats.num_puts_skipped_stored += len(keys) - len(todo)
            if todo:
                value_keys = layout.write_keys([all_keys[i] for i in todo])
                size = layout.payload_size
                batch = ValueBatch(len(value_keys), size, self._storage(layout))
                rows = slice(start, end) if len(todo) == len(keys) else todo
                layout.pack(snapshot, rows, batch.payloads)
                batch.seal(value_keys)
                self.backend.put_from(value_keys, batch.buffer)
                stats.num_blocks_put += len(todo)
                stats.num_bytes_put += batch.buffer.nbytes
        except StoreError as e:
            stats.num_put_failures += len(keys)
            _failures.warning("put", "store: %d blocks not stored: %s", len(keys), e)
            self._report_partial(layout, keys)
            return
        self.recent_keys.add_many(keys)
        if self.on_stored is not None:
            self.on_stored(keys, True)

    def _stored(self, layout: HeadLayout, keys: list[str]) -> list[bool]:
        """Per block of ``keys``: whether every value this rank writes for it is stored."""
        n = layout.num_written
        exists = self.backend.exists_many(layout.write_keys(keys))
        return [all(exists[i * n : (i + 1) * n]) for i in range(len(keys))]

    def _report_partial(self, layout: HeadLayout, keys: list[str]) -> None:
        """After a failed put, tell ``on_stored`` which blocks made it anyway (a batch can fail
        halfway: a disk that fills up), so that none is stored unknown to its owner."""
        if self.on_stored is None:
            return
        try:
            stored = self._stored(layout, keys)
        except StoreError:
            stored = [False] * len(keys)
        self.on_stored([k for k, s in zip(keys, stored) if s], True)
        self.on_stored([k for k, s in zip(keys, stored) if not s], False)

    def _delete(self, job: DeleteJob) -> None:
        self.recent_keys.discard_many(job.keys)
        try:
            self.backend.delete_many(job.value_keys)
        except StoreError as e:
            _failures.warning("delete", "store: %d blocks not deleted: %s", len(job.keys), e)

    def _storage(self, layout: HeadLayout) -> np.ndarray:
        """The reused encode buffer, sized for a whole batch of the largest values seen so far,
        and registered with the backend (a zero-copy backend puts straight from it)."""
        nbytes = ValueBatch.nbytes_for(PUT_BATCH_BLOCKS * layout.num_written, layout.payload_size)
        if self._buffer is None or len(self._buffer) < nbytes:
            if self._buffer is not None:
                self.backend.unregister_buffer(self._buffer)
            self._buffer = np.empty(nbytes, dtype=np.uint8)
            self.backend.register_buffer(self._buffer)
        return self._buffer
