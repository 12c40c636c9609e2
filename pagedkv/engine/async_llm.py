"""AsyncLLM: the LLMEngine behind an asyncio API, for servers.

One background thread owns the (not thread-safe) LLMEngine. Event-loop coroutines talk to it
through two one-way channels, so the engine's state is only ever touched by its own thread:

    event loop                          engine thread
    ----------                          -------------
    add_request(): tokenize, validate   (nothing yet)
      commands.put(enqueue)   ------->  run commands, then engine.step() while requests exist;
    abort(): commands.put(abort) ---->  block on the command queue when idle (no busy spin)
    RequestStream  <--- call_soon_threadsafe(queue.put_nowait, output) per RequestOutput

Every command is applied before the next step, so requests submitted while a step runs all
join the following step's batch: concurrent clients share engine steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from pagedkv.engine.engine_args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import RequestOutput, merge_deltas
from pagedkv.engine.request_input import NewRequest, RequestInput
from pagedkv.engine.scheduler_stats import SchedulerStats
from pagedkv.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or a step raised): no request can be served."""


class RequestAbortedError(RuntimeError):
    """The request was ended from outside (the server is shutting down); the message says why."""


class StatLogger(Protocol):
    def record(self, stats: SchedulerStats, finished: list[RequestOutput]) -> None:
        """Called on the engine thread after every loop iteration: the scheduler's stats (read
        them now, they change on the next step) and the requests that just finished."""


class RequestStream:
    """The outputs of one request, pushed by the engine thread into an asyncio queue.

    Iterate it with ``async for``: it yields RequestOutputs and ends after the final one. A
    slow reader gets what piled up as one output: the newest (cumulative outputs hold the
    older ones), or with ``deltas`` (``RequestOutputKind.DELTA``) all of them merged. Leaving
    the iteration early (break, cancellation, a client that went away) aborts the request,
    which frees its KV cache blocks.
    """

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        abort: Callable,
        deltas: bool = False,
    ) -> None:
        self.request_id = request_id
        self.deltas = deltas
        self.finished = False
        self._loop = loop
        self._abort = abort
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Engine thread: deliver an output or an error."""
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                while not isinstance(item, BaseException) and not self._queue.empty():
                    newer = self._queue.get_nowait()
                    deltas = self.deltas and not isinstance(newer, BaseException)
                    item = merge_deltas(item, newer) if deltas else newer
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:
                self._abort(self.request_id, self)


class AsyncLLM:
    """An LLMEngine stepped by a background thread; ``generate`` is an async iterator.

    Call ``add_request``/``generate`` from one event loop; ``abort`` and ``shutdown`` from any
    thread.
    """

    def __init__(self, args: EngineArgs, stat_loggers: Sequence[StatLogger] = ()) -> None:
        #: Owned by the engine thread: use it from elsewhere only for immutable facts
        #: (tokenizer, limits, ``make_request``) or once ``shutdown`` has returned.
        self.llm_engine = LLMEngine(args)
        self.stat_loggers = list(stat_loggers)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        #: Engine thread only: the stream of every request the engine holds.
        self._streams: dict[str, RequestStream] = {}
        #: Why the engine thread ended; set (under ``_lock``) once it has.
        self._dead: BaseException | None = None
        self._lock = threading.Lock()
        self._stopping = False
        #: Once stopping: the engine still steps until it holds nothing, or until this time.
        self._drain_deadline = 0.0
        publisher = self.llm_engine.kv_event_publisher
        if publisher is not None:  # an idle engine answers a snapshot request at once
            publisher.wake_engine = lambda: self._commands.put(self.llm_engine.publish_kv_events)
        #: Set once the engine thread has ended because it failed (not by ``shutdown``).
        self.failed = threading.Event()
        self.llm_engine.executor.on_rank_death(self._rank_died)
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ read-only engine facts
    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm_engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    # ------------------------------------------------------------------ the API side
    def add_request(self, request: RequestInput) -> RequestStream:
        """Tokenize and validate here (bad input raises ValueError now), then submit.

        Must be called from the running event loop that will read the returned stream.
        """
        new = self.llm_engine.make_request(request)
        deltas = new.children[0].sampling_params.output_kind is RequestOutputKind.DELTA
        stream = RequestStream(new.request_id, asyncio.get_running_loop(), self.abort, deltas)
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine is not running: {self._dead}")
            self._commands.put(lambda: self._enqueue(new, stream))
        return stream

    async def generate(self, request: RequestInput) -> AsyncIterator[RequestOutput]:
        """The outputs of one request (``params.output_kind``: cumulative by default), the last
        one ``finished``. Bad input raises ValueError at the first iteration, before anything
        reaches the engine."""
        async for output in self.add_request(request):
            yield output

    def abort(self, request_id: str, stream: RequestStream | None = None) -> None:
        """Abort a request (no-op if it already finished); its blocks are freed at once.

        With ``stream``, only if the request holding ``request_id`` is that stream's: a stream
        whose request was refused (its id was in use) must not abort the one that holds it.
        """
        self._commands.put(lambda: self._abort(request_id, stream))

    def abort_all(self, reason: str) -> None:
        """End every request in flight with ``RequestAbortedError(reason)``; their blocks are
        freed at once (a server that must stop now)."""
        self._commands.put(lambda: self._abort_all(reason))

    def shutdown(self, timeout: float = 10.0, drain_s: float = 0.0) -> None:
        """Stop the engine thread. With ``drain_s``, the engine first finishes what it still
        holds (requests, and KV a peer is still pulling from its held blocks) for up to that
        long; what is left then ends with EngineDeadError."""
        self._commands.put(lambda: self._stop(drain_s))
        self._thread.join(timeout + drain_s)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        engine = self.llm_engine
        try:
            while not self._done():
                # Block while idle; otherwise take whatever arrived during the last step.
                self._run_commands(block=not engine.has_unfinished_requests())
                if not self._done() and engine.has_unfinished_requests():
                    self._publish(engine.step())
        except Exception as e:
            logger.exception("engine thread failed")
            dead: BaseException = e
            failed = True
        else:
            dead = EngineDeadError("the engine was shut down")
            failed = False
        with self._lock:  # no command can arrive after this
            self._dead = dead
        for stream in self._streams.values():
            stream.put(EngineDeadError(f"the engine stopped: {dead}"))
        self._streams.clear()
        self._run_commands(block=False)  # late arrivals: _enqueue refuses them now
        if failed:
            self.failed.set()

    def _rank_died(self, why: str) -> None:
        """A tensor-parallel rank died (the executor's monitor thread): end the engine thread,
        even an idle one, so in-flight requests fail and ``is_running`` turns false now."""

        def fail() -> None:
            if self._dead is None:  # else the step already failed with it
                raise EngineDeadError(why)

        self._commands.put(fail)

    def _run_commands(self, block: bool) -> None:
        """Run queued commands until the queue is empty (waiting for the first if ``block``)."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return
            command()
            block = False

    def _enqueue(self, new: NewRequest, stream: RequestStream) -> None:
        if self._dead is not None:
            stream.put(EngineDeadError(f"the engine stopped: {self._dead}"))
            return
        try:
            self.llm_engine.enqueue_request(new)
        except ValueError as e:  # e.g. the request id is in use
            stream.put(e)
            return
        self._streams[new.request_id] = stream

    def _done(self) -> bool:
        """Stopping, and nothing left to drain (or the drain's time is up)."""
        return self._stopping and (
            not self.llm_engine.has_unfinished_requests()
            or time.monotonic() >= self._drain_deadline
        )

    def _abort_all(self, reason: str) -> None:
        if self._dead is not None:
            return
        streams, self._streams = self._streams, {}
        self.llm_engine.abort_request(list(streams))
        for stream in streams.values():
            stream.put(RequestAbortedError(reason))

    def _abort(self, request_id: str, stream: RequestStream | None) -> None:
        if self._dead is not None:
            return
        if stream is not None and self._streams.get(request_id) is not stream:
            return
        self._publish(self.llm_engine.abort_request(request_id))

    def _stop(self, drain_s: float) -> None:
        self._stopping = True
        self._drain_deadline = time.monotonic() + drain_s

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Record stats, then deliver: a client that has its answer finds it in the stats."""
        finished = [output for output in outputs if output.finished]
        if self.stat_loggers:
            stats = self.llm_engine.get_stats()
            for stat_logger in self.stat_loggers:
                stat_logger.record(stats, finished)
        for output in outputs:
            if output.finished:
                stream = self._streams.pop(output.request_id, None)
            else:
                stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
