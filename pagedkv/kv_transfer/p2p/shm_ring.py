"""ShmRing: one direction of a same-host pair's shared memory, a single-producer
single-consumer ring of messages (the sending lane writes, the receiving lane reads).

Layout (all offsets in bytes from the ring's start)::

    0     head: messages published (written by the producer only)
    64    tail: messages consumed (written by the consumer only; its own cache line)
    128   NUM_SLOTS descriptors of 4 int64: data offset, size, tag, sequence number
    DATA  ``capacity`` bytes of message data, handed out first in, first out

The producer writes a message's bytes, then its descriptor, then ``head``; the consumer reads
``head``, then the descriptor, then the bytes. Plain aligned 8-byte stores and loads keep that
order on x86-64 (TSO: stores are not reordered with stores, loads not with loads), and each
step is a separate compiled call, so the compiler can't reorder them either. A message is
received only once its descriptor is published: a producer killed mid-write leaves a message
that is never seen, never a half-written one. Data offsets are 64-byte aligned, so a message
can be viewed as any dtype.
"""

from __future__ import annotations

import torch

NUM_SLOTS = 1024
_HEAD, _TAIL = 0, 8  # int64 word indices
_DESC = 16  # first descriptor word
_DATA = 128 + NUM_SLOTS * 32
_ALIGN = 64


def ring_bytes(capacity: int) -> int:
    """Bytes of a ring holding ``capacity`` bytes of messages."""
    return _DATA + capacity


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


class ShmRing:
    def __init__(self, region: torch.Tensor) -> None:
        self._words = region[:_DATA].numpy().view("int64")
        self.data = region[_DATA:]
        self.capacity = self.data.numel()
        self._head = int(self._words[_HEAD])  # producer's own count
        self._tail = int(self._words[_TAIL])  # consumer's own count
        self._write = 0  # producer: where the next message's data goes
        self._reserved: tuple[int, int] | None = None

    # ------------------------------------------------------------------ producer
    def reserve(self, size: int) -> torch.Tensor | None:
        """Room for a message of ``size`` bytes (to fill, then ``publish``), or None until
        the consumer has released older ones."""
        span = _aligned(size)
        if span > self.capacity:
            raise ValueError(f"a {size}-byte message does not fit the {self.capacity}-byte ring")
        tail = int(self._words[_TAIL])
        if self._head - tail >= NUM_SLOTS:
            return None
        if tail == self._head:  # empty: start over
            start = 0
        else:
            first = int(self._words[_DESC + 4 * (tail % NUM_SLOTS)])
            end = self._write
            if end > first:  # in use: [first, end)
                start = end if end + span <= self.capacity else 0 if span <= first else -1
            else:  # wrapped, in use: [first, capacity) and [0, end)
                start = end if end + span <= first else -1
            if start < 0:
                return None
        self._reserved = (start, size)
        return self.data[start : start + size]

    def publish(self, tag: int) -> int:
        """The reserved message is written: make it visible to the consumer. Returns its
        sequence number (see ``consumed``)."""
        assert self._reserved is not None
        start, size = self._reserved
        self._reserved = None
        desc = _DESC + 4 * (self._head % NUM_SLOTS)
        self._words[desc : desc + 4] = (start, size, tag, self._head)
        self._write = start + _aligned(size)
        self._head += 1
        self._words[_HEAD] = self._head
        return self._head - 1

    def consumed(self, seq: int) -> bool:
        """Whether the consumer has released message ``seq`` (and all before it)."""
        return int(self._words[_TAIL]) > seq

    # ------------------------------------------------------------------ consumer
    def peek(self) -> tuple[int, torch.Tensor] | None:
        """The oldest unreleased message, ``(tag, bytes)``, or None while none is published."""
        if int(self._words[_HEAD]) == self._tail:
            return None
        desc = _DESC + 4 * (self._tail % NUM_SLOTS)
        start, size, tag, seq = (int(w) for w in self._words[desc : desc + 4])
        if seq != self._tail or not 0 <= start <= start + size <= self.capacity:
            raise ValueError(f"corrupt descriptor {self._tail}: {(start, size, tag, seq)}")
        return tag, self.data[start : start + size]

    def release(self) -> None:
        """The oldest message has been consumed: its room goes back to the producer."""
        self._tail += 1
        self._words[_TAIL] = self._tail
