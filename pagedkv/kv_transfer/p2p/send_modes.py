"""How P sends a transfer: one small class per ``send_type`` behind one interface.

Every send goes through the pair group's SendLane (lanes.py); the modes differ in where the
lane reads the KV from and when::

                 while the forward computes the prompt         after the request finished
    PUT          layer by layer from the paged cache; the      from the held blocks
                 step ends only once it has left (zero copy)
    PUT_ASYNC    layer by layer from copies made as each       from the held blocks
                 layer is computed (the step does not wait)
    GET          never                                         from a copy in the send pool
                                                               (the blocks are freed at once)

A piece of a transfer between instances of different tensor-parallel sizes (head_plan.py)
sends only its KV heads (``SendSpec.kv_heads``): every mode reads its blocks narrowed to them
(transfer.py's ``narrow_heads``); PUT_ASYNC copies only those heads, GET copies whole blocks.

Copies (PUT_ASYNC's layers, GET's pool) count against ``kv_buffer_size``: past it PUT_ASYNC
sends from the held blocks after the request finished, and GET refuses the transfer (NACK).

D's WANT often reaches P after P's forward has started (D sends it once its own scheduler
admits the request, while the proxy dispatched both at once). PUT and PUT_ASYNC then *join*
the forward (``join``): the layers it has computed already go from the paged cache (a prompt's
KV is written once, and its blocks are held until the transfer ends), the rest as the forward
computes them, so the KV still leaves layer by layer instead of after the forward.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from pagedkv.distributed.shard import Shard
from pagedkv.kv_transfer.p2p.lanes import Job, LaneError
from pagedkv.kv_transfer.p2p.send_pool import SendPool
from pagedkv.kv_transfer.p2p.transfer import (
    LayerBlocks,
    block_bytes,
    gather_blocks,
    narrow_heads,
)
from pagedkv.kv_transfer.p2p.transfer_state import Outbound
from pagedkv.utils import cdiv

logger = logging.getLogger(__name__)


@dataclass
class SendContext:
    """What every mode reads: the paged cache, each layer's KV cache group, the copy budget,
    and the checkpoint's first KV head the cache holds (this rank's)."""

    kv_caches: list[torch.Tensor]
    layer_groups: list[int]
    block_size: int
    pool: SendPool
    timeout_s: float
    first_head: int = 0

    def narrow(self, cache: torch.Tensor, kv_heads: Shard | None) -> torch.Tensor:
        return narrow_heads(cache, kv_heads, self.first_head)


class HeldSource:
    """A transfer read from blocks that stay put until the lane is done with it (only the
    checkpoint's ``kv_heads`` of them, when given)."""

    def __init__(
        self, caches: list[torch.Tensor], ctx: SendContext, ids, segments, kv_heads=None
    ) -> None:
        self._caches, self._ctx, self._ids, self._segments = caches, ctx, ids, segments
        self._kv_heads = kv_heads

    def layer(self, layer_idx: int) -> LayerBlocks:
        g = self._ctx.layer_groups[layer_idx]
        cache = self._ctx.narrow(self._caches[layer_idx], self._kv_heads)
        return LayerBlocks(cache, self._ids[g], self._segments[g])


class StreamSource:
    """A transfer sent while the forward computes it: layer ``i`` is there once the forward
    has written it (``put``), as the cache itself (PUT) or a copy (PUT_ASYNC)."""

    def __init__(self, num_layers: int, timeout_s: float) -> None:
        self._layers: list[LayerBlocks | None] = [None] * num_layers
        self._cond = threading.Condition()
        self._timeout_s = timeout_s

    def put(self, layer_idx: int, blocks: LayerBlocks) -> None:
        with self._cond:
            self._layers[layer_idx] = blocks
            self._cond.notify_all()

    def layer(self, layer_idx: int) -> LayerBlocks:
        with self._cond:
            if not self._cond.wait_for(lambda: self._layers[layer_idx] is not None,
                                       self._timeout_s):  # fmt: skip
                raise LaneError(f"layer {layer_idx} was not computed in {self._timeout_s}s")
            blocks = self._layers[layer_idx]
            self._layers[layer_idx] = None  # sent once: the copy goes with the message
            assert blocks is not None
            return blocks


@dataclass(eq=False)
class _Streaming:
    job: Job
    source: StreamSource
    ids: list[torch.Tensor]
    segments: list[list[int]]
    kv_heads: Shard | None


class SendMode:
    """One send type. Engine-thread hooks: ``prepare`` (a finished request's blocks are held),
    ``stream`` / ``save_layer`` / ``wait_for_save`` (the forward completing prompts)."""

    def __init__(self, ctx: SendContext) -> None:
        self.ctx = ctx
        #: Guards the forward's progress below: the engine thread advances it, a WANT arriving
        #: on the listener thread may join it.
        self._lock = threading.RLock()
        #: Transfers streamed in the forward being run.
        self._streaming: list[_Streaming] = []
        #: The transfers whose prompts the forward being run completes, and how many of its
        #: layers it has written (``save_layer``); empty between forwards.
        self._in_forward: set[str] = set()
        self._layers_done = 0

    def num_bytes(self, ids: list[torch.Tensor], kv_heads: Shard | None = None) -> int:
        return sum(
            block_bytes(self.ctx.narrow(cache, kv_heads)) * len(ids[g])
            for cache, g in zip(self.ctx.kv_caches, self.ctx.layer_groups)
        )

    def _job(self, rec: Outbound, segments: list[list[int]], source, num_bytes: int) -> Job:
        """The lane's job for ``rec``, its messages ``num_heads`` KV heads per block."""
        kv_heads = self.kv_heads(rec)
        num_heads = kv_heads.size if kv_heads is not None else self.ctx.kv_caches[0].shape[3]
        return Job(rec.transfer_id, segments, source, num_bytes, num_heads)

    @staticmethod
    def kv_heads(rec: Outbound) -> Shard | None:
        """The checkpoint's KV heads the transfer sends (None: all this rank holds)."""
        return rec.spec.kv_heads if rec.spec is not None else None

    def ids(self, rec: Outbound) -> list[torch.Tensor]:
        """Per KV cache group, where the wanted blocks are: block ids in the paged cache."""
        assert rec.want is not None and rec.spec is not None
        return [
            torch.tensor([ids[i] for i in ix], dtype=torch.int64)
            for ix, ids in zip(rec.want.block_indices, rec.spec.block_ids)
        ]

    def prepare(self, rec: Outbound) -> str | None:
        """The request finished and its blocks are held: make the transfer sendable after
        the fact (engine thread, outside the owner's lock). Returns why it can't be."""
        return None

    #: Whether the blocks may be freed once ``prepare`` succeeded (the KV was copied).
    frees_blocks_early = False

    def whole(self, rec: Outbound, ids: list[torch.Tensor], segments: list[list[int]]) -> Job:
        """The transfer as one job, from the held blocks."""
        heads = self.kv_heads(rec)
        source = HeldSource(self.ctx.kv_caches, self.ctx, ids, segments, heads)
        return self._job(rec, segments, source, self.num_bytes(ids, heads))

    def stream(
        self, rec: Outbound, ids: list[torch.Tensor], segments: list[list[int]]
    ) -> Job | None:
        """The transfer as a job fed by this step's forward, or None: sent afterwards."""
        return None

    def begin_forward(self, transfer_ids: list[str]) -> None:
        """The forward about to run completes these transfers' prompts (engine thread)."""
        with self._lock:
            self._in_forward = set(transfer_ids)
            self._layers_done = 0

    def join(self, rec: Outbound, ids: list[torch.Tensor], segments: list[list[int]]) -> Job | None:
        """A WANT that arrived while the forward completing its prompt runs: the transfer as a
        job fed by the rest of that forward (the layers done already from the paged cache),
        or None (no such forward now: sent once the request has finished)."""
        with self._lock:
            if rec.transfer_id not in self._in_forward:
                return None
            job = self.stream(rec, ids, segments)
            done = self._layers_done
        if job is not None:
            assert isinstance(job.source, StreamSource)
            for layer_idx in range(done):
                g = self.ctx.layer_groups[layer_idx]
                cache = self.ctx.narrow(self.ctx.kv_caches[layer_idx], self.kv_heads(rec))
                job.source.put(layer_idx, LayerBlocks(cache, ids[g], segments[g]))
        return job

    def save_layer(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        g = self.ctx.layer_groups[layer_idx]
        with self._lock:
            self._layers_done = layer_idx + 1
            streaming = list(self._streaming)
        for s in streaming:
            if not s.job.ended.is_set():  # not cancelled before its batch started
                cache = self.ctx.narrow(kv_cache, s.kv_heads)
                s.source.put(layer_idx, self._layer_of(cache, s.ids[g], s.segments[g]))

    def _layer_of(self, cache: torch.Tensor, ids: torch.Tensor, segments: list[int]) -> LayerBlocks:
        return LayerBlocks(cache, ids, segments)

    def wait_for_save(self) -> None:
        self._end_forward()

    def _end_forward(self) -> list[_Streaming]:
        """The forward is over: no transfer joins it any more. Returns its streams."""
        with self._lock:
            streaming, self._streaming = self._streaming, []
            self._in_forward = set()
        return streaming

    def release(self, transfer_id: str) -> None:
        """The transfer no longer needs its copies (sent, or ended)."""
        self.ctx.pool.pop(transfer_id)

    def _start_stream(self, rec: Outbound, ids, segments) -> Job:
        source = StreamSource(len(self.ctx.kv_caches), self.ctx.timeout_s)
        heads = self.kv_heads(rec)
        job = self._job(rec, segments, source, self.num_bytes(ids, heads))
        with self._lock:
            self._streaming.append(_Streaming(job, source, ids, segments, heads))
        return job


class PutMode(SendMode):
    """PUT: sent from the paged cache as the forward computes it; the step waits for it."""

    def stream(self, rec, ids, segments) -> Job | None:
        return self._start_stream(rec, ids, segments)

    def wait_for_save(self) -> None:
        """The blocks may change once the step is over: their sends must have left (each
        gloo wait of the lane is bounded by ``transfer_timeout_s``)."""
        for s in self._end_forward():
            while not s.job.ended.wait(self.ctx.timeout_s):
                logger.warning("PUT: still sending %s at the end of the step", s.job.transfer_id)


class PutAsyncMode(SendMode):
    """PUT_ASYNC: each layer is copied as the forward computes it; the lane sends the copies
    while the engine goes on (copies within ``kv_buffer_size``, else sent afterwards)."""

    def stream(self, rec, ids, segments) -> Job | None:
        if not self.ctx.pool.reserve(rec.transfer_id, self.num_bytes(ids, self.kv_heads(rec))):
            return None
        return self._start_stream(rec, ids, segments)

    def _layer_of(self, cache, ids, segments) -> LayerBlocks:
        copy = gather_blocks(cache, ids)  # in wire order: messages are slices of it
        return LayerBlocks(copy, torch.arange(len(ids)), segments)


class GetMode(SendMode):
    """GET: the KV is copied into the send pool when the request finishes (its blocks are
    freed at once) and sent when D's WANT is there."""

    frees_blocks_early = True

    def ids(self, rec: Outbound) -> list[torch.Tensor]:
        """Block-table positions in the pool copy."""
        assert rec.want is not None
        return [torch.tensor(ix, dtype=torch.int64) for ix in rec.want.block_indices]

    def prepare(self, rec: Outbound) -> str | None:
        assert rec.spec is not None
        num_blocks = cdiv(rec.spec.num_prompt_tokens, self.ctx.block_size)
        ids = [torch.tensor(b[:num_blocks], dtype=torch.int64) for b in rec.spec.block_ids]
        num_bytes = self.num_bytes(ids)
        pool = self.ctx.pool
        if not pool.reserve(rec.transfer_id, num_bytes):
            return (
                f"send pool full ({pool.used_bytes} of {pool.capacity_bytes} bytes used, "
                f"{num_bytes} needed)"
            )
        copies = [
            gather_blocks(cache, ids[g])
            for cache, g in zip(self.ctx.kv_caches, self.ctx.layer_groups)
        ]
        if not pool.fill(rec.transfer_id, copies):
            return "the transfer ended while its KV was copied"
        return None

    def whole(self, rec, ids, segments) -> Job:
        """From the pool copy; ``ids`` are block-table positions in it."""
        entry = self.ctx.pool.get(rec.transfer_id)
        if entry is None:
            raise LaneError("the send pool copy is gone")
        heads = self.kv_heads(rec)
        source = HeldSource(entry.layers, self.ctx, ids, segments, heads)
        return self._job(rec, segments, source, self.num_bytes(ids, heads))


SEND_MODES: dict[str, type[SendMode]] = {"PUT": PutMode, "PUT_ASYNC": PutAsyncMode, "GET": GetMode}
