"""The offloading connector's counters, per tier, and its load latency buckets.

Each counter has one writer thread (the engine thread, or one tier's writer), so plain integer
fields suffice; a reader may see a value one update old.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

#: Load latency buckets (seconds, upper bounds) of ``offload_load_seconds``.
LOAD_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _as_stats(counters: object, tier: str) -> dict[str, int]:
    """``num_offload_<tier>_<counter>`` for each counter field."""
    return {
        f"num_offload_{tier}_{f.name.removeprefix('num_')}": getattr(counters, f.name)
        for f in fields(counters)  # type: ignore[arg-type]
    }


@dataclass(slots=True)
class TierCounters:
    """The scheduler half's, per tier."""

    #: Prompt tokens found in this tier at admission (loaded instead of computed).
    num_hit_tokens: int = 0
    #: Stores not planned: the tier was full of pending or pinned entries.
    num_stores_dropped: int = 0
    num_lookup_errors: int = 0

    def as_stats(self, tier: str) -> dict[str, int]:
        return _as_stats(self, tier)


@dataclass(slots=True)
class TierIOCounters:
    """The worker half's, per tier."""

    #: Bytes written into the tier (stores and promotions) and read out of it (loads).
    num_bytes_in: int = 0
    num_bytes_out: int = 0
    #: Stores not written: the tier's writer queue was full (backpressure) ...
    num_stores_backpressured: int = 0
    #: ... or the write failed (a full disk, a store down).
    num_store_failures: int = 0
    #: Blocks a load could not use: missing, corrupt, or the tier failed.
    num_load_misses: int = 0

    def as_stats(self, tier: str) -> dict[str, int]:
        return _as_stats(self, tier)
