"""TPGroup: one rank's view of its tensor-parallel group, and the collectives the model runs.

Every rank runs the same layers on the same tokens, so every rank calls the same collectives in
the same order; a result is the same bits on every rank, which keeps the ranks' residual
streams identical (in shared memory: the rank-order sum in fp32, rounded once; gloo's ring adds
in an order of its own, the same on every rank). ``SINGLE_RANK`` is the group of one: each
collective returns its input.

Ranks on one host meet in shared memory too (``shm_all_reduce.py``): all-reduces of CPU
fp32/bf16/fp16 tensors and gathers of CPU tensors go through it, anything else through gloo.
Which path a call takes depends only on what every rank agreed at ``init_tp_group`` and on the
tensor's device and dtype (the same on every rank), so the ranks never disagree.
"""

from __future__ import annotations

import datetime

import torch
from torch.distributed import (
    FileStore,
    GatherOptions,
    PrefixStore,
    ProcessGroup,
    ProcessGroupGloo,
    ReduceOp,
)

from pagedkv.distributed.shm_all_reduce import SHM_SLOT_BYTES, ShmAllReduce


class TPGroup:
    """``rank`` of ``world_size``; ``pg`` the ranks' process group (None for one rank, and once
    closed); ``shm`` their shared-memory collectives (None: gloo only)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        pg: ProcessGroup | None = None,
        shm: ShmAllReduce | None = None,
    ) -> None:
        if world_size > 1 and pg is None:
            raise ValueError("a tensor-parallel group of several ranks needs a process group")
        self.rank = rank
        self.world_size = world_size
        self.pg = pg
        self.shm = shm

    @property
    def is_first(self) -> bool:
        """Rank 0: the rank that samples and returns the step's tokens."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (same shape and dtype on each), in place; returns x."""
        if self.world_size == 1:
            return x
        if self.shm is not None and self.shm.supports_all_reduce(x):
            return self.shm.all_reduce(x)
        self._process_group().allreduce([x], ReduceOp.SUM).wait()
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape and dtype on each), in rank order, on rank 0; None on
        the other ranks."""
        if self.world_size == 1:
            return [x]
        if self.shm is not None and x.is_cpu:
            return self.shm.gather(x)
        x = x.contiguous()
        options = GatherOptions()
        options.rootRank = 0
        pg = self._process_group()
        if self.rank == 0:
            out = [torch.empty_like(x) for _ in range(self.world_size)]
            pg.gather([out], [x], options).wait()
            return out
        pg.gather([], [x], options).wait()
        return None

    def barrier(self) -> None:
        """Return once every rank has called it."""
        if self.world_size > 1:
            self.all_reduce(torch.zeros(1))

    def abort(self) -> None:
        """Give up on the group, from any thread: a rank waiting in a shared-memory collective
        (this one or another) raises at once instead of after the timeout. Over gloo a dead
        peer's closed sockets do the same by themselves."""
        if self.shm is not None:
            self.shm.close()  # thread-safe: a collective in progress keeps the mapping

    def close(self) -> None:
        """The rank leaves the group: a rank still waiting in a shared-memory collective with
        it raises at once instead of after the timeout; the shared memory is unmapped and the
        process group shut down and dropped (a gloo group left to the interpreter's exit can
        abort the process). A collective after ``close`` raises."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.pg is not None:
            self.pg.shutdown()
            self.pg = None

    def _process_group(self) -> ProcessGroup:
        if self.pg is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank}: the group is closed")
        return self.pg


SINGLE_RANK = TPGroup(0, 1)


def init_tp_group(
    rank: int,
    world_size: int,
    store_path: str,
    timeout_s: float,
    shm_slot_bytes: int | None = SHM_SLOT_BYTES,
) -> TPGroup:
    """Rank ``rank``'s group, meeting the others through the file ``store_path`` (same host: a
    private directory, no listening port) over gloo on loopback, and in shared memory with
    slots of ``shm_slot_bytes`` (None: gloo only). Every collective, and the meeting itself,
    fails after ``timeout_s`` rather than wait forever on a dead rank."""
    if world_size == 1:
        return SINGLE_RANK
    store = FileStore(store_path, world_size)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    options = ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = ProcessGroupGloo(PrefixStore("tp", store), rank, world_size, options)
    shm = None
    if shm_slot_bytes is not None:
        shm_store = PrefixStore("shm", store)
        shm = ShmAllReduce.meet(shm_store, rank, world_size, shm_slot_bytes, timeout_s)
    return TPGroup(rank, world_size, pg, shm)
