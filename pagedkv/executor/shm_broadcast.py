"""ShmBroadcast: each step's message written once into shared memory and read by every worker
rank (vLLM's shared-memory message queue, without pickle: the bytes are msgspec's).

Layout of the segment (int64 words; each counter on its own 64-byte cache line)::

    word 0          written: slots published (the writer's only)
    word 8          closed: 1 once the writer is gone (readers stop waiting at once)
    word 16 + 8*i   read[i]: slots reader i has finished with (reader i's only)
    HEADER ...      NUM_SLOTS slots of SLOT_BYTES: [message length, chunk length, chunk bytes]

Slot ``s`` carries the ``s``-th chunk published; a message longer than one slot's payload
spans consecutive slots, each naming the whole message's length. The writer fills a slot only
once every reader's ``read`` has passed it (``s - NUM_SLOTS < min(read)``), writes the bytes,
then the two lengths, then ``written``; a reader reads ``written``, then the slot. Plain aligned
8-byte stores and loads keep those orders on x86-64 (TSO), as in ``p2p/shm_ring.py``.

Readers sleep in ``select`` on a pipe the writer writes one byte to after each publish, so an
idle rank costs no CPU and a step's message wakes it at once.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import select
import time
from collections.abc import Callable

import numpy as np

NUM_SLOTS = 8
SLOT_BYTES = 1 << 20
_LENGTHS = 16  # the two int64 lengths at the start of a slot
_PAYLOAD = SLOT_BYTES - _LENGTHS
_WRITTEN, _CLOSED, _READ0 = 0, 8, 16
_CACHE_LINE_WORDS = 8


class BroadcastClosed(RuntimeError):
    """The writer is gone, or a wait ran out of time."""


def _header_bytes(num_readers: int) -> int:
    return 8 * (_READ0 + _CACHE_LINE_WORDS * num_readers)


def segment_bytes(num_readers: int) -> int:
    return _header_bytes(num_readers) + NUM_SLOTS * SLOT_BYTES


def create_segment(num_readers: int) -> int:
    """A fresh anonymous segment (a memfd, mode 0600, nothing to unlink) for ``num_readers``;
    its fd, to hand to each reader process (``pass_fds``) and to ``ShmBroadcast``."""
    fd = os.memfd_create("pagedkv-tp-broadcast", os.MFD_CLOEXEC)
    os.fchmod(fd, 0o600)
    os.ftruncate(fd, segment_bytes(num_readers))
    return fd


class ShmBroadcast:
    """The writer (``reader`` None) or reader ``reader`` of the segment ``fd``."""

    def __init__(self, fd: int, num_readers: int, reader: int | None = None) -> None:
        self._mapping = mmap.mmap(fd, segment_bytes(num_readers))
        header = _header_bytes(num_readers)
        self._words = np.frombuffer(self._mapping, dtype=np.int64, count=header // 8)
        self._slots = np.frombuffer(self._mapping, dtype=np.uint8, offset=header)
        self.num_readers = num_readers
        self.reader = reader
        #: The writer's count of slots published; a reader's count of slots read.
        self._seq = int(self._words[_WRITTEN]) if reader is None else int(self._read_word(reader))

    def _read_word(self, reader: int) -> np.int64:
        return self._words[_READ0 + _CACHE_LINE_WORDS * reader]

    def _slot(self, seq: int) -> np.ndarray:
        start = (seq % NUM_SLOTS) * SLOT_BYTES
        return self._slots[start : start + SLOT_BYTES]

    # ------------------------------------------------------------------ writer
    def publish(self, message: bytes, wake_fds: list[int], check: Callable[[], None]) -> None:
        """Write ``message`` once for every reader, then wake them (one byte on each of
        ``wake_fds``). ``check()`` may raise while the writer waits for a slot to free up."""
        view = memoryview(message)
        offset = 0
        while True:
            self._wait_for_free_slot(check)
            chunk = view[offset : offset + _PAYLOAD]
            slot = self._slot(self._seq)
            slot[_LENGTHS : _LENGTHS + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            slot[:_LENGTHS].view(np.int64)[:] = (len(message), len(chunk))
            self._seq += 1
            self._words[_WRITTEN] = self._seq
            offset += len(chunk)
            if offset >= len(message):
                break
        for fd in wake_fds:
            # A full pipe holds wake-ups enough: the reader is awake anyway.
            with contextlib.suppress(BlockingIOError):
                os.write(fd, b"\0")

    def _wait_for_free_slot(self, check: Callable[[], None]) -> None:
        sleep_s = 1e-5
        while True:
            oldest = min(int(self._read_word(i)) for i in range(self.num_readers))
            if self._seq - oldest < NUM_SLOTS:
                return
            check()
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, 1e-3)

    def close(self) -> None:
        """The writer is done: every reader's wait ends."""
        self._words[_CLOSED] = 1

    # ------------------------------------------------------------------ reader
    def receive(self, wake_fd: int, timeout_s: float | None = None) -> bytes:
        """The next message (waiting on ``wake_fd`` for it). Raises BroadcastClosed once the
        writer closed the segment or its end of the wake-up pipe, or after ``timeout_s``."""
        first = self._next_chunk(wake_fd, timeout_s)
        total, length = (int(v) for v in first[:_LENGTHS].view(np.int64))
        if length == total:
            message = first[_LENGTHS : _LENGTHS + length].tobytes()
            self._release()
            return message
        out = bytearray(total)
        offset = 0
        chunk = first
        while True:
            length = int(chunk[:_LENGTHS].view(np.int64)[1])
            out[offset : offset + length] = chunk[_LENGTHS : _LENGTHS + length].data
            offset += length
            self._release()
            if offset >= total:
                return bytes(out)
            chunk = self._next_chunk(wake_fd, timeout_s)

    def _release(self) -> None:
        assert self.reader is not None
        self._seq += 1
        self._words[_READ0 + _CACHE_LINE_WORDS * self.reader] = self._seq

    def _next_chunk(self, wake_fd: int, timeout_s: float | None) -> np.ndarray:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while int(self._words[_WRITTEN]) <= self._seq:
            if self._words[_CLOSED]:
                raise BroadcastClosed("the executor closed the broadcast")
            wait_s = 1.0 if deadline is None else deadline - time.monotonic()
            if wait_s <= 0:
                raise BroadcastClosed(f"no message within {timeout_s:g} s")
            if select.select([wake_fd], [], [], min(wait_s, 1.0))[0]:
                _drain(wake_fd)
        return self._slot(self._seq)


def _drain(fd: int) -> None:
    """Take every wake-up byte waiting on ``fd`` (non-blocking); BroadcastClosed at EOF."""
    try:
        data = os.read(fd, 4096)
    except OSError as e:
        if e.errno == errno.EAGAIN:
            return
        raise
    if not data:
        raise BroadcastClosed("the executor's end of the wake-up pipe closed")
