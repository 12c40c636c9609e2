"""PrefixLocator: where a request's blocks past its pool hit are, top tier first, and how long
a prefix of them can be loaded (in whole blocks, every group's window stored).

The host and disk tiers answer from their ``TierIndex`` (in memory, every time: an entry may
be evicted between two steps); the remote tier with one ``exists_all`` per request (a block is
there once each of its KV heads is), reused for ``LOOKUP_REUSE_S`` while the request is not
admitted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.kv_connector.protocols import ConnectorRequest
from pagedkv.kv_transfer.offload.stats import TierCounters
from pagedkv.kv_transfer.offload.tier_index import TierIndex
from pagedkv.kv_transfer.store.backends import StoreBackend, StoreError
from pagedkv.kv_transfer.store.block_codec import head_keys
from pagedkv.kv_transfer.store.connector import LOOKUP_REUSE_S, longest_stored_prefix
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)
_failures = RateLimitedLog(logger)


@dataclass(slots=True)
class Lookup:
    start_block: int
    #: Per group, per block from ``start_block``: the tier holding it ("cpu", "disk",
    #: "remote") or None.
    sources: list[list[str | None]]
    #: Blocks loadable from ``start_block``.
    num_blocks: int = 0
    remote_checked_at: float = -float("inf")
    #: Per group, per block: in the remote tier (the last ``exists_many``).
    in_remote: list[list[bool]] = field(default_factory=list)


class PrefixLocator:
    def __init__(
        self,
        tiers: dict[str, TierIndex],
        remote: StoreBackend | None,
        remote_counters: TierCounters | None,
        key: Callable[[int, bytes], str],
        windows: list[int | None],
        heads: range,
    ) -> None:
        """``heads``: the checkpoint's KV heads, each a value of its own in the remote tier."""
        self.tiers = tiers
        self.remote = remote
        self.remote_counters = remote_counters
        self.key = key
        self.windows = windows
        self.heads = heads
        self.num_groups = len(windows)
        self.lookups: dict[str, Lookup] = {}

    def locate(self, request: ConnectorRequest, start: int, end: int) -> Lookup:
        """Where each block from ``start`` to ``end`` is, top tier first."""
        hashes = request.block_hashes
        sources: list[list[str | None]] = [
            [
                next(
                    (
                        name
                        for name, index in self.tiers.items()
                        if index.ready(self.key(g, hashes[i]))
                    ),
                    None,
                )
                for i in range(start, end)
            ]
            for g in range(self.num_groups)
        ]
        lookup = self.lookups.get(request.request_id)
        if lookup is None or lookup.start_block != start or len(lookup.sources[0]) != end - start:
            lookup = Lookup(start, sources)
            self.lookups[request.request_id] = lookup
        lookup.sources = sources
        if self.remote is not None:
            self._check_remote(request, lookup, end)
            for group_sources, in_remote in zip(sources, lookup.in_remote):
                for i, stored in enumerate(in_remote):
                    if stored and group_sources[i] is None:
                        group_sources[i] = "remote"
        stored = [[source is not None for source in group] for group in sources]
        lookup.num_blocks = longest_stored_prefix(stored, self.windows)
        return lookup

    def _check_remote(self, request: ConnectorRequest, lookup: Lookup, end: int) -> None:
        assert self.remote is not None and self.remote_counters is not None
        now = time.monotonic()
        if now - lookup.remote_checked_at <= LOOKUP_REUSE_S and lookup.in_remote:
            return
        lookup.remote_checked_at = now
        start = lookup.start_block
        keys = [
            head_keys([self.key(g, request.block_hashes[i])], self.heads)
            for g in range(self.num_groups)
            for i in range(start, end)
        ]
        try:
            exists = self.remote.exists_all(keys)
        except StoreError as e:
            self.remote_counters.num_lookup_errors += 1
            _failures.warning("lookup", "remote tier lookup failed, a miss: %s", e)
            exists = [False] * len(keys)
        n = end - start
        lookup.in_remote = [exists[g * n : (g + 1) * n] for g in range(self.num_groups)]
