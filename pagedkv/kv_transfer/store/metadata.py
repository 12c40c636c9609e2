"""What the store connector's scheduler half tells its worker half each step (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.kv_connector.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class BlockRef:
    """One block of one KV cache group, and the store key of its KV."""

    group_id: int
    block_id: int
    key: str


@dataclass(slots=True)
class StoreLoad:
    """Load a request's ``blocks`` from the store: between steps (``is_async``), or before
    this step's forward pass."""

    req_id: str
    blocks: list[BlockRef]
    is_async: bool


@dataclass
class StoreConnectorMetadata(KVConnectorMetadata):
    #: Blocks whose KV became complete in this step's forward pass, with their owner request.
    saves: list[tuple[str, BlockRef]] = field(default_factory=list)
    loads: list[StoreLoad] = field(default_factory=list)
    #: Finished requests whose blocks are held until their puts have ended.
    flushes: list[str] = field(default_factory=list)
    #: Async loads to stop (request aborted or past its deadline).
    cancels: list[str] = field(default_factory=list)
