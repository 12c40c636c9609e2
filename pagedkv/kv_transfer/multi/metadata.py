"""MultiConnectorMetadata: one step's plan of a MultiConnector, down to its worker half."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.kv_connector.base import KVConnectorMetadata


@dataclass
class MultiConnectorMetadata(KVConnectorMetadata):
    #: Each child's own metadata, by position.
    children: tuple[KVConnectorMetadata, ...]
    #: Requests that finished this step with their blocks held by two children or more: the
    #: positions of those children. The worker reports such a request in ``finished_sending``
    #: once each of them has.
    holders: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: Requests admitted this step whose KV two children or more load, one after the other:
    #: the positions of those children. The worker reports such a request in
    #: ``finished_recving`` once each of them has.
    loaders: dict[str, tuple[int, ...]] = field(default_factory=dict)
