"""A request's transfer split into this rank's pieces (head_plan.py), and their reports joined.

The scheduler half plans per request; each rank's worker half turns every event about a
request into events about the pieces this rank takes part in, each a transfer of its own for
the owners (its own record, WANT, lease, lane and end), under its own transfer and request
ids. A piece's end is reported under its request id; ``PieceReports`` reports the request
once each of its pieces has ended on this rank: sent (P), or received (D: the union of the
pieces' failed blocks, the first failure's reason). On D a failed piece fails its request, so
the pieces still under way are cancelled (``take_cancels``: by the maintenance thread, as the
owner's lock may be held when a piece reports). The executor then joins the ranks: a
request counts once every rank reported it, so a rank with no piece of a transfer (a P rank
whose heads another rank sends) reports it when its blocks are held, at once.

With the same tensor-parallel size on both sides a rank has exactly one piece per request,
the request's own transfer under its own ids, with its whole blocks: nothing is renamed,
counted or narrowed (the same-TP path).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import NamedTuple

from pagedkv.distributed.shard import Shard, TPLayout
from pagedkv.kv_transfer.p2p.connector import LoadSpec, RemoteLoad, SendSpec
from pagedkv.kv_transfer.p2p.head_plan import (
    Piece,
    piece_transfer_id,
    plan_pieces,
    rank_address,
    rank_engine_id,
)
from pagedkv.kv_transfer.p2p.transfer_state import Finished

logger = logging.getLogger(__name__)


class PieceReports:
    """The owners' ``Finished`` for pieces: a request split into several reports once all of
    them ended (``expect`` names them first); any other id passes straight through."""

    def __init__(self, finished: Finished) -> None:
        self._finished = finished
        self._lock = threading.Lock()
        #: Piece request id -> its request; request -> its pieces not yet ended.
        self._request_of: dict[str, str] = {}
        self._pending: dict[str, set[str]] = {}
        #: D: the failed blocks and first failure of a request's ended pieces.
        self._invalid: dict[str, set[int]] = {}
        self._error: dict[str, str] = {}
        #: D: pieces still under way of a request another piece of which failed.
        self._cancels: list[str] = []

    def expect(self, request_id: str, piece_ids: list[str]) -> None:
        if piece_ids == [request_id]:
            return
        with self._lock:
            self._pending[request_id] = set(piece_ids)
            self._request_of.update(dict.fromkeys(piece_ids, request_id))

    def pieces_of(self, request_id: str) -> list[str]:
        """The pieces of a request not yet ended (the request itself if not split)."""
        with self._lock:
            return sorted(self._pending.get(request_id, [request_id]))

    def _ended(self, piece_id: str) -> str | None:
        """The piece ended (lock held): its request, once every piece of it has."""
        request_id = self._request_of.pop(piece_id, None)
        if request_id is None:
            return piece_id
        pending = self._pending[request_id]
        pending.discard(piece_id)
        if pending:
            return None
        del self._pending[request_id]
        return request_id

    def sending(self, piece_id: str) -> None:
        with self._lock:
            request_id = self._ended(piece_id)
        if request_id is not None:
            self._finished.sending(request_id)

    def recving(self, piece_id: str, invalid_block_ids: set[int], error: str | None) -> None:
        with self._lock:
            key = self._request_of.get(piece_id, piece_id)
            self._invalid.setdefault(key, set()).update(invalid_block_ids)
            if error is not None and key not in self._error:
                self._error[key] = error
                self._cancels.extend(self._pending.get(key, set()) - {piece_id})
            request_id = self._ended(piece_id)
            if request_id is None:
                return
            invalid = self._invalid.pop(request_id)
            error = self._error.pop(request_id, None)
        self._finished.recving(request_id, invalid, error)

    def take_cancels(self) -> list[str]:
        """D: the pieces to cancel, each once: their request failed already."""
        with self._lock:
            cancels, self._cancels = self._cancels, []
        return cancels

    def in_progress(self, piece_ids: list[str]) -> None:
        with self._lock:
            request_ids = [self._request_of.get(piece_id, piece_id) for piece_id in piece_ids]
        self._finished.in_progress(list(dict.fromkeys(request_ids)))


class _Mine(NamedTuple):
    """One of this rank's pieces of a request's transfer, under its own ids."""

    piece: Piece
    request_id: str
    transfer_id: str


class TPPieces:
    """This rank's pieces of each transfer: rank ``tp.rank`` of ``tp.size``, its cache holding
    the checkpoint's KV heads ``own`` of ``num_kv_heads``."""

    def __init__(self, tp: TPLayout, num_kv_heads: int, own: Shard, reports: PieceReports):
        self.tp = tp
        self.num_kv_heads = num_kv_heads
        self.own = own
        self.reports = reports
        #: P: an arrived request -> its pieces' request ids, until it departs.
        self._arrived: dict[str, list[str]] = {}

    def _mine(
        self, request_id: str, transfer_id: str, p_size: int, d_size: int, producer: bool
    ) -> list[_Mine]:
        """The pieces this rank takes part in, as P (``producer``) or as D; ValueError when
        the two sizes can't share the heads."""
        rank = self.tp.rank
        mine = []
        for piece in plan_pieces(self.num_kv_heads, p_size, d_size):
            if (piece.p_rank if producer else piece.d_rank) != rank:
                continue
            tid = piece_transfer_id(transfer_id, piece, p_size, d_size)
            rid = request_id if tid == transfer_id else f"{request_id}/{tid}"
            mine.append(_Mine(piece, rid, tid))
        return mine

    def _heads(self, piece: Piece) -> Shard | None:
        return None if piece.kv_heads == self.own else piece.kv_heads

    # ------------------------------------------------------------------ D
    def loads(self, spec: LoadSpec) -> list[LoadSpec]:
        """D: the loads of a request's pieces (their ends joined in ``reports``)."""
        if spec.remote is None or spec.error is not None:
            return [spec]
        p = spec.remote_tp_size or self.tp.size
        try:
            mine = self._mine(spec.request_id, spec.transfer_id, p, self.tp.size, False)
        except ValueError as e:
            return [replace(spec, remote=None, error=f"kv_transfer_params.remote_tp_size: {e}")]
        loads = [
            replace(
                spec,
                request_id=m.request_id,
                transfer_id=m.transfer_id,
                remote=rank_address(spec.remote, m.piece.p_rank),
                remote_tp_size=p,
                kv_heads=self._heads(m.piece),
            )
            for m in mine
        ]
        self.reports.expect(spec.request_id, [load.request_id for load in loads])
        return loads

    def remote_loads(self, load: RemoteLoad) -> list[RemoteLoad]:
        """D: a request's transfer from P as its pieces' (queued, abandoned)."""
        if load.remote is None:
            return [load]
        p = load.remote_tp_size or self.tp.size
        try:
            mine = self._mine("", load.transfer_id, p, self.tp.size, False)
        except ValueError:
            return []
        return [
            RemoteLoad(m.transfer_id, rank_address(load.remote, m.piece.p_rank), None, p)
            for m in mine
        ]

    # ------------------------------------------------------------------ P
    def _mine_as_p(self, request_id: str, transfer_id: str, d_size: int | None) -> list[_Mine]:
        try:
            return self._mine(request_id, transfer_id, self.tp.size, d_size or self.tp.size, True)
        except ValueError as e:
            logger.warning("transfer %s: not sent from here: %s", transfer_id, e)
            return []

    def sends(self, spec: SendSpec, remote_tp_size: int | None) -> list[SendSpec]:
        """P: the sends of a transfer's pieces from this rank (none: other ranks send every
        head this one holds)."""
        sends = []
        for m in self._mine_as_p(spec.request_id, spec.transfer_id, remote_tp_size):
            expected = spec.expected_peer
            if expected is not None:
                expected = rank_engine_id(expected, m.piece.d_rank)
            sends.append(
                replace(
                    spec,
                    request_id=m.request_id,
                    transfer_id=m.transfer_id,
                    expected_peer=expected,
                    kv_heads=self._heads(m.piece),
                )
            )
        return sends

    def hold(self, spec: SendSpec, remote_tp_size: int | None) -> list[SendSpec]:
        """P: a finished request's blocks are held for these sends; with none, they are
        reported sent at once."""
        sends = self.sends(spec, remote_tp_size)
        if not sends:
            self.reports.sending(spec.request_id)
        else:
            self.reports.expect(spec.request_id, [send.request_id for send in sends])
        return sends

    def transfer_ids(self, transfer_id: str, remote_tp_size: int | None) -> list[str]:
        """P: the transfer ids of a transfer's pieces from this rank."""
        return [m.transfer_id for m in self._mine_as_p("", transfer_id, remote_tp_size)]

    def arrived(
        self, request_id: str, transfer_id: str, remote_tp_size: int | None
    ) -> list[tuple[str, str]]:
        """P: a request arrived: its pieces' (request id, transfer id), remembered until it
        departs."""
        mine = self._mine_as_p(request_id, transfer_id, remote_tp_size)
        self._arrived[request_id] = [m.request_id for m in mine]
        return [(m.request_id, m.transfer_id) for m in mine]

    def departed(self, request_id: str) -> list[str]:
        """P: the pieces' request ids of a request that departed."""
        return self._arrived.pop(request_id, [])
