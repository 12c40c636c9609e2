"""ShmAllReduce: all-reduce and gather between the ranks of one host through shared memory.

A decode step's all-reduce moves a few kilobytes; over gloo (loopback TCP) that is system
calls and wake-ups: 4 KiB between two ranks took 170-370 us on this project's 2-core machine,
against about 7 us here (``benchmarks/all_reduce.py``). Each rank copies its tensor into its
own slot of the group's segment (``group_segment.py``), announces it by a counter, and reads
the others' slots directly (``csrc/shm_all_reduce.cpp``).

The protocol. Each rank numbers its collectives 1, 2, 3, ... (``seq``; every rank calls the
same collectives in the same order, so the numbers agree; the one-call decode layer's
all-reduces, run from C, take theirs from the same counter). Rank r has one counter ``c[r]``
(the last seq it published) and two slots, ``slot[r][seq % 2]``. Collective ``seq``:

1. free:    wait until ``c[q] >= seq - 1`` for every rank q;
2. write:   copy the tensor into ``slot[r][seq % 2]``;
3. publish: ``c[r] = seq`` (a release store);
4. wait:    (readers only) until ``c[q] >= seq`` for every q (acquire loads);
5. read:    all-reduce: every rank sums ``slot[0] + slot[1] + ...`` in rank order, in fp32
            (bf16/fp16 rounded once at the end), into its tensor; gather: rank 0 copies out
            every slot. The other ranks of a gather skip steps 4 and 5.

Why a slot is never overwritten while someone reads it. A reader of ``slot[r][p]`` for
collective s reads it between its step 4 of s and its step 3 of s + 1: it publishes s + 1
only after reading s. Rank r next writes ``slot[r][p]`` for s + 2, after its step 1 of s + 2
saw ``c[q] >= s + 1`` for every q: each reader had published s + 1, so had finished
reading s. Step 1 costs nothing after an all-reduce (its step 4 saw ``c[q] >= seq`` already);
it matters after a gather, whose writers do not wait. Why a reader sees the data of s, not
older or newer bytes: it reads after seeing ``c[r] >= s``; rank r stored ``c[r] = s`` after
writing the slot (release store after the copy, acquire load before the read: on x86-64, TSO
keeps plain stores in order and loads in order, so these are plain moves; no non-temporal store
is used, so no fence is needed), and rank r can't write that slot again (for s + 2) before the
reader publishes s + 1, as above. The ordering is argued for x86-64, the only architecture this
path runs on (elsewhere: gloo).

The sum is the same operations in the same order on every rank, so every rank gets the same
bits (the ranks' residual streams stay identical). A tensor larger than a slot is sent in
slot-sized chunks, one collective each. Waiting spins briefly, then yields the core, then
sleeps in short naps (ranks may share cores); a rank that does not arrive within the timeout
(dead) makes the call raise a RuntimeError naming it, and the waiting rank then closes the
group: a word in the header that makes every other rank's wait return at once, and that
``close`` sets on shutdown.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from typing import NoReturn

import torch
from torch.distributed import Store

from pagedkv.cpu_kernels import load_cpu_kernels
from pagedkv.distributed.group_segment import CLOSED_WORD, GroupSegment

logger = logging.getLogger(__name__)

#: Bytes of each slot (two per rank): a decode step's hidden states fit in one collective;
#: a long prefill's go in chunks of this size.
SHM_SLOT_BYTES = 4 << 20
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_OK, _TIMEOUT, _CLOSED = 0, 1, 2  # the C functions' statuses


class _ShmGroup(ctypes.Structure):
    """``struct ShmGroup`` of csrc/shm_all_reduce.cpp."""

    _fields_ = [
        ("base", ctypes.c_void_p),
        ("slot_bytes", ctypes.c_int64),
        ("timeout_ns", ctypes.c_int64),
        ("world_size", ctypes.c_int32),
        ("rank", ctypes.c_int32),
    ]


_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
#: (group, seq or its address, ..., who) -> status: the C functions' arguments.
_SIGNATURES = {
    "shm_all_reduce_next": [_P, _P, _P, _I64, _I32, _P],
    "shm_gather": [_P, _I64, _P, _I64, _P, _I64, _P],
}


class ShmAllReduce:
    """Rank ``rank``'s shared-memory collectives; ``close`` releases the segment."""

    def __init__(
        self, segment: GroupSegment, library: ctypes.CDLL, rank: int, timeout_s: float
    ) -> None:
        self._segment: GroupSegment | None = segment
        self.rank = rank
        self.world_size = segment.world_size
        self.timeout_s = timeout_s
        self._group = _ShmGroup(
            segment.buffer.data_ptr(),
            segment.slot_bytes,
            int(timeout_s * 1e9),
            segment.world_size,
            rank,
        )
        self._who = ctypes.c_int32(0)
        self._group_ref = ctypes.byref(self._group)
        self._who_ref = ctypes.byref(self._who)
        #: The last collective's sequence number: C code (``shm_all_reduce_next``) numbers
        #: all-reduces on from it, Python the gathers, so the rank's collectives, wherever they
        #: run, take 1, 2, 3, ... in the order they are called.
        self._seq = ctypes.c_int64(0)
        self._seq_ref = ctypes.byref(self._seq)
        for name, argtypes in _SIGNATURES.items():
            getattr(library, name).argtypes = argtypes
            getattr(library, name).restype = _I32
        self._all_reduce = library.shm_all_reduce_next
        self._gather = library.shm_gather
        self._close = library.shm_group_close
        self._close.argtypes = [_P, _I32]
        self._close.restype = None

    @classmethod
    def meet(
        cls, store: Store, rank: int, world_size: int, slot_bytes: int, timeout_s: float
    ) -> ShmAllReduce | None:
        """Every rank's collectives, or None on every rank when one of them can't use them
        (no compiled library, not x86-64, no shared memory): the group then uses gloo."""
        library = load_cpu_kernels() if platform.machine() in ("x86_64", "AMD64") else None
        segment = GroupSegment.meet(store, rank, world_size, slot_bytes, library is not None)
        if segment is None or library is None:
            logger.info("tensor-parallel collectives over gloo (no shared-memory path here)")
            return None
        return cls(segment, library, rank, timeout_s)

    @staticmethod
    def supports_all_reduce(x: torch.Tensor) -> bool:
        return x.is_cpu and x.dtype in _DTYPES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The rank-order sum of every rank's ``x`` (CPU fp32/bf16/fp16), in place; returns x."""
        y = x if x.is_contiguous() else x.contiguous()
        args = (self._seq_ref, y.data_ptr(), y.numel(), _DTYPES[x.dtype])
        self._call("all_reduce", self._all_reduce, *args)
        if y is not x:
            x.copy_(y)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's CPU ``x``, in rank order, on rank 0 (views of one buffer); None on
        the other ranks."""
        y = x if x.is_contiguous() else x.contiguous()
        nbytes = y.numel() * y.element_size()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype) if self.rank == 0 else None
        chunk = self._open().slot_bytes
        for start in range(0, nbytes, chunk):
            self._seq.value += 1
            dst = None if out is None else out.data_ptr() + start
            args = (self._seq.value, y.data_ptr() + start, min(chunk, nbytes - start), dst, nbytes)
            self._call("gather", self._gather, *args)
        return None if out is None else list(out.unbind(0))

    def close(self) -> None:
        """Close the group (every rank still waiting in a collective raises at once) and let
        the segment go: it is unmapped once no call holds it, so ``close`` may come from
        another thread while a collective waits (that call then raises)."""
        if self._segment is None:
            return
        self._close(self._group_ref, -1)
        self._segment = None

    def _open(self) -> GroupSegment:
        if self._segment is None:
            raise RuntimeError("the tensor-parallel group's shared memory is closed")
        return self._segment

    def call_with_group(self, function: ctypes._CFuncPtr, *args: object) -> int:
        """``function(*args, group, seq, who)``: a C function that runs this rank's all-reduces
        itself, through ``shm_all_reduce_next`` with this object's group and sequence counter
        (the one-call decode layer). Returns its status, unless that is an all-reduce's failure
        (1 or 2): then the RuntimeError ``all_reduce`` raises, and the group closed."""
        segment = self._open()  # held: the mapping stays while the call may touch it
        status = function(*args, self._group_ref, self._seq_ref, self._who_ref)
        if status in (_TIMEOUT, _CLOSED):
            self._fail("all_reduce", status, segment)
        return status

    def _call(self, op: str, function: ctypes._CFuncPtr, *args: object) -> None:
        """``function(group, *args, who)``; a RuntimeError naming the missing rank (and the
        group closed) unless it succeeded."""
        segment = self._open()  # held: the mapping stays while the call may touch it
        status = function(self._group_ref, *args, self._who_ref)
        if status != _OK:
            self._fail(op, status, segment)

    def _fail(self, op: str, status: int, segment: GroupSegment) -> NoReturn:
        """Raise the RuntimeError for ``op``'s failure ``status`` (timed out or closed), naming
        the missing rank, and close the group."""
        who = self._who.value
        if status == _TIMEOUT:
            self._close(self._group_ref, who)
            problem = f"rank {who} did not arrive within {self.timeout_s:g} s"
        else:
            missing = (int(segment.header[CLOSED_WORD]) & 0xFFFFFFFF) - 1
            problem = (
                f"rank {missing} did not arrive within {self.timeout_s:g} s (rank {who} gave up)"
                if missing >= 0
                else f"rank {who} closed the group"
            )
        self.close()
        raise RuntimeError(f"tensor-parallel {op} on rank {self.rank}: {problem}")
