"""What the offloading connector's halves tell each other each step (plain data).

Down (``OffloadingMetadata``): the blocks this step completed, to store into each tier; the
loads to start; the disk files of evicted entries; loads to cancel. Up (``OffloadReport``, the
``worker_meta`` of the step's output): which stores ended, and which entries a load found bad.
Under tensor parallelism every rank reports every store and load it was handed (its own KV
heads'); ``OffloadReport.combine`` puts one step's reports together, and the scheduler half
counts a store as ended once every rank reported it (``rank_reports.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.kv_connector.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class TierBlock:
    """One block of one KV cache group: its pool block, its store key, and its slot in the
    host tier's buffer (None for the other tiers, whose blocks are found by key)."""

    group_id: int
    block_id: int
    key: str
    slot: int | None = None


@dataclass(slots=True)
class OffloadLoad:
    """Load a request's blocks into the pool, between steps."""

    req_id: str
    #: Tier name ("cpu", "disk", "remote") -> the blocks read from it.
    blocks: dict[str, list[TierBlock]]
    #: Blocks read from a lower tier that are copied up into the host tier as well (their
    #: ``slot``: the host slot reserved for them).
    promotions: list[TierBlock] = field(default_factory=list)


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    #: Tier name -> blocks whose KV this step completed, to store there.
    saves: dict[str, list[TierBlock]] = field(default_factory=dict)
    loads: list[OffloadLoad] = field(default_factory=list)
    #: Tier name -> keys evicted there (files to delete).
    deletes: dict[str, list[str]] = field(default_factory=dict)
    cancels: list[str] = field(default_factory=list)


@dataclass(slots=True)
class OffloadReport:
    #: (tier name, key, stored?) for every store that ended, promotions included.
    stores: list[tuple[str, str, bool]] = field(default_factory=list)
    #: (tier name, key): entries a load found missing, corrupt or unreadable.
    bad: list[tuple[str, str]] = field(default_factory=list)
    #: Seconds each finished load took, from its submission, by request id.
    load_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.stores or self.bad or self.load_seconds)

    @classmethod
    def combine(cls, reports: Sequence[OffloadReport | None]) -> OffloadReport | None:
        """The tensor-parallel ranks' reports of one step as one: every rank's stores (a key
        once per rank that reported it), bad entries, and each load's longest time."""
        combined = cls()
        for report in reports:
            if report is None:
                continue
            combined.stores.extend(report.stores)
            combined.bad.extend(report.bad)
            for req_id, seconds in report.load_seconds.items():
                combined.load_seconds[req_id] = max(seconds, combined.load_seconds.get(req_id, 0))
        return None if combined.is_empty else combined
