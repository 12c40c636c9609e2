"""TPGroup: one rank's view of its tensor-parallel group, and the collectives the model runs.

Every rank runs the same layers on the same tokens, so every rank calls the same collectives in
the same order; a result is the same bits on every rank (sums are added in rank order), which
keeps the ranks' residual streams identical. ``SINGLE_RANK`` is the group of one: each
collective returns its input.
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


class TPGroup:
    """``rank`` of ``world_size``; ``pg`` the ranks' process group (None for one rank)."""

    def __init__(self, rank: int, world_size: int, pg: ProcessGroup | None = None) -> None:
        if world_size > 1 and pg is None:
            raise ValueError("a tensor-parallel group of several ranks needs a process group")
        self.rank = rank
        self.world_size = world_size
        self.pg = pg

    @property
    def is_first(self) -> bool:
        """Rank 0: the rank that samples and returns the step's tokens."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (same shape and dtype on each), in place; returns x."""
        if self.pg is None:
            return x
        self.pg.allreduce([x], ReduceOp.SUM).wait()
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape and dtype on each), in rank order, on rank 0; None on
        the other ranks."""
        if self.pg is None:
            return [x]
        x = x.contiguous()
        options = GatherOptions()
        options.rootRank = 0
        if self.rank == 0:
            out = [torch.empty_like(x) for _ in range(self.world_size)]
            self.pg.gather([out], [x], options).wait()
            return out
        self.pg.gather([], [x], options).wait()
        return None

    def close(self) -> None:
        """This rank gives up on the group (idempotent): a peer that died releases a rank
        blocked in a gloo collective by itself (its sockets close), so there is nothing more to
        do over gloo."""


SINGLE_RANK = TPGroup(0, 1)


def init_tp_group(rank: int, world_size: int, store_path: str, timeout_s: float) -> TPGroup:
    """Rank ``rank``'s group, meeting the others through the file ``store_path`` (same host: a
    private directory, no listening port) over gloo on loopback. Every collective, and the
    meeting itself, fails after ``timeout_s`` rather than wait forever on a dead rank."""
    if world_size == 1:
        return SINGLE_RANK
    store = FileStore(store_path, world_size)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    options = ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = ProcessGroupGloo(PrefixStore("tp", store), rank, world_size, options)
    return TPGroup(rank, world_size, pg)
