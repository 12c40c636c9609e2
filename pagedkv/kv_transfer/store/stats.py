"""Counters of one store connector half.

Each counter has a single writer thread (the engine thread, the writer or the loader), so plain
integer fields suffice; readers may see a value one update old.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The scheduler half's counters (the worker half has the others).
LOOKUP_STATS = ("num_lookups", "num_lookup_errors", "num_hit_blocks")


@dataclass(slots=True)
class StoreStats:
    # scheduler half
    num_lookups: int = 0
    num_lookup_errors: int = 0
    #: Blocks (of every group) found stored beyond the local prefix hit, at admission.
    num_hit_blocks: int = 0
    # worker half: puts
    num_blocks_put: int = 0
    num_bytes_put: int = 0
    #: Blocks not written because this instance stored them recently (engine thread) ...
    num_puts_skipped_recent: int = 0
    #: ... or because the writer found them in the store (writer thread).
    num_puts_skipped_stored: int = 0
    #: Blocks not written because the writer's queue was full.
    num_puts_dropped: int = 0
    num_put_failures: int = 0
    # worker half: loads
    num_blocks_loaded: int = 0
    num_bytes_loaded: int = 0
    #: Blocks that could not be loaded, by cause; each one ends in ``invalid_block_ids``.
    num_load_missing: int = 0
    num_load_corrupt: int = 0
    num_load_errors: int = 0
    num_load_cancelled: int = 0

    @property
    def num_load_invalid(self) -> int:
        return (
            self.num_load_missing
            + self.num_load_corrupt
            + self.num_load_errors
            + self.num_load_cancelled
        )
