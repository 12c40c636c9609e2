"""Which P rank sends which KV heads to which D rank, whatever the two tensor-parallel sizes.

Every rank of an instance is a P2P peer of its own (``rank_address``): rank ``r`` listens on
``kv_port + r`` under the engine id ``<engine id>`` (rank 0: the instance's own address, the
one kv_transfer_params name) or ``<engine id>.tp<r>``. Both ranks of a pair learn the other
instance's size from the request's kv_transfer_params (``remote_tp_size``; absent: the same
size as their own).

D rank ``r`` of ``d`` holds the checkpoint's KV heads ``kv_head_shard(H, r, d)``; P rank ``s``
of ``p`` those of ``kv_head_shard(H, s, p)`` (vLLM's rule: with fewer heads than ranks each
head is replicated). D rank ``r`` takes each of its heads from one P rank that holds it,
``holders[r % len(holders)]``, and the heads it takes from one P rank are one *piece*: one
transfer between one P rank and one D rank (its own WANT, lane and report), KV heads
``[start, end)`` of the blocks::

    H = 8, p = 2, d = 1    D0 <- P0 heads [0, 4), D0 <- P1 heads [4, 8)
    H = 8, p = 1, d = 2    D0 <- P0 heads [0, 4), D1 <- P0 heads [4, 8)
    H = 1, p = 2, d = 1    D0 <- P0 head 0 (P1 holds the same head: it sends nothing)
    p == d                 D r <- P r, its whole blocks: the same-TP path

Both sides compute the same pieces (``plan_pieces`` is pure), so each P rank knows which D
ranks will ask it for what, and a P rank that sends nothing reports its transfer at once.
A piece's transfer id is the request's own when ``p == d`` (one piece per rank pair), else
``piece_transfer_id``: unique per (transfer, P rank, D rank).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from pagedkv.distributed.shard import Shard, kv_head_shard
from pagedkv.transport.peer_addr import PeerAddr


class Piece(NamedTuple):
    """KV heads ``kv_heads`` (a range of the checkpoint's) go from P rank ``p_rank`` to D rank
    ``d_rank``."""

    p_rank: int
    d_rank: int
    kv_heads: Shard


def rank_engine_id(engine_id: str, rank: int) -> str:
    """The engine id of rank ``rank`` of the instance ``engine_id`` (rank 0: the same)."""
    return engine_id if rank == 0 else f"{engine_id}.tp{rank}"


def rank_address(instance: PeerAddr, rank: int) -> PeerAddr:
    """Where rank ``rank`` of the instance at ``instance`` (its rank 0) listens."""
    return PeerAddr(rank_engine_id(instance.engine_id, rank), instance.host, instance.port + rank)


@functools.lru_cache(maxsize=64)
def plan_pieces(num_kv_heads: int, p_size: int, d_size: int) -> tuple[Piece, ...]:
    """Every piece of a transfer from a P of ``p_size`` ranks to a D of ``d_size``, by D rank
    then head: each D rank's heads covered exactly once, each from a P rank holding them."""
    p_shards = [kv_head_shard(num_kv_heads, s, p_size) for s in range(p_size)]
    pieces: list[Piece] = []
    for d_rank in range(d_size):
        own = kv_head_shard(num_kv_heads, d_rank, d_size)
        for head in range(own.start, own.end):
            holders = [s for s, shard in enumerate(p_shards) if shard.start <= head < shard.end]
            p_rank = holders[d_rank % len(holders)]
            last = pieces[-1] if pieces else None
            if last is not None and last[:2] == (p_rank, d_rank) and last.kv_heads.end == head:
                grown = Shard(last.kv_heads.start, last.kv_heads.size + 1)
                pieces[-1] = Piece(p_rank, d_rank, grown)
            else:
                pieces.append(Piece(p_rank, d_rank, Shard(head, 1)))
    return tuple(pieces)


def piece_transfer_id(transfer_id: str, piece: Piece, p_size: int, d_size: int) -> str:
    """The transfer id a piece travels under (the request's own when ``p_size == d_size``)."""
    if p_size == d_size:
        return transfer_id
    return f"{transfer_id}/tp{piece.p_rank}-{piece.d_rank}"
