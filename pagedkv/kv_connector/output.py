"""KVConnectorOutput: what a KV connector's worker half reports up after a step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVConnectorOutput:
    """What a KV connector's worker half reports after a step."""

    #: Producer: transfers whose held blocks may now be freed (delivered, refused, failed or
    #: lease expired).
    finished_sending: set[str] = field(default_factory=set)
    #: Consumer: loads that ended (successfully or not); no byte lands in their blocks after.
    finished_recving: set[str] = field(default_factory=set)
    #: Blocks whose load failed (reported with or before the request's finished_recving).
    invalid_block_ids: set[int] = field(default_factory=set)
    #: Consumer: why a load failed, by request id (the peer and the cause), for the error a
    #: client sees under kv_load_failure_policy=fail.
    load_errors: dict[str, str] = field(default_factory=dict)
    #: Consumer: loads whose source still computes their KV (their request is queued or in
    #: prefill there): their deadline counts from now.
    loads_in_progress: set[str] = field(default_factory=set)
    #: A connector's own report from its worker half to its scheduler half, opaque to the
    #: engine (the offloading connector's finished stores and bad tier entries). Plain data.
    worker_meta: Any = None

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.finished_recving
            or self.invalid_block_ids
            or self.loads_in_progress
            or self.worker_meta is not None
        )

    @classmethod
    def merge(cls, outputs: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
        """One report of several connectors' (a composite's children, in order): the union of
        each set, the load errors merged (an earlier output's error for a request wins), and
        ``worker_meta`` the tuple of theirs, by position (None when each is None)."""
        merged = cls()
        for output in outputs:
            merged.finished_sending |= output.finished_sending
            merged.finished_recving |= output.finished_recving
            merged.invalid_block_ids |= output.invalid_block_ids
            merged.loads_in_progress |= output.loads_in_progress
            merged.load_errors = {**output.load_errors, **merged.load_errors}
        metas = tuple(output.worker_meta for output in outputs)
        if any(meta is not None for meta in metas):
            merged.worker_meta = metas
        return merged
