"""KVIndex: which instances' KV tiers hold which blocks, mirrored from their KV events.

Block hashes are chained (a block's hash covers its whole prefix) and equal across processes,
so a map ``block hash -> instances`` is enough: an instance's cached prefix of a prompt is the
run of the prompt's block hashes, from the first, that it holds::

    prompt hashes   h0   h1   h2   h3
    instance A      ✓    ✓    ✓    ·      -> 3 blocks cached
    instance B      ✓    ·    ✓    ✓      -> 1 (h2 alone is useless: its prefix is gone)

Every event carries its tier (``medium``: "GPU" for the instance's pool, "CPU", "DISK",
"REMOTE" for its offloading connector's tiers), and each tier is mirrored apart: per instance,
per medium, how many blocks of each (group, hash) are cached (a tier may hold two blocks under
one hash), so the mirror is exact: ``cached(name, medium)`` equals what that tier holds. A
block is held in a medium when every KV cache group of the instance holds it there
(``num_groups``, from its registration), as the instance's own lookup requires. A prompt's
cached prefix is the run of its blocks each held in some medium (the instance looks up pool,
then host, disk, remote), each credited at its cheapest (``tier_costs.py``)::

    prompt hashes   h0   h1   h2   h3
    A: GPU          ✓    ✓    ·    ·
    A: CPU          ✓    ✓    ✓    ·      -> {"GPU": 2, "CPU": 1}

``AllBlocksCleared`` clears the pool (GPU) only: it is what the pool sends when its prefix
cache is reset, as in vLLM, where the event has no medium and comes from the GPU block pool
alone; a tier that drops blocks says so with ``BlockRemoved`` of its medium. (Dynamo's
indexer, which mirrors one tier per worker, clears the worker whole.)

Blocks on their way: once the router sends a prompt to an instance, the prompt's full blocks
will be cached in its pool within a step or so, but their event comes only then. ``expect``
counts them as held in its pool meanwhile (until their pool ``BlockStored`` or
``BlockRemoved``, or ``EXPECT_TTL_S``), so requests that share a prefix and arrive together go
where it is being computed, as a text-based router's would. Written by the subscriber thread
and the event loop: one lock, held for short operations only.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence

from pagedkv.entrypoints.proxy.tier_costs import (
    DEFAULT_TIER_COSTS,
    normalize_medium,
    tier_cost,
)
from pagedkv.kv_cache.kv_events import GPU
from pagedkv.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, WireEvent

BlockKey = tuple[int, bytes]  # (group, hash)
#: How long a block the router sent somewhere counts as held there without its event.
EXPECT_TTL_S = 10.0


class KVIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: hash -> medium -> instance -> number of its groups that hold the hash there
        self._holders: dict[bytes, dict[str, dict[str, int]]] = {}
        #: instance -> medium -> (group, hash) -> number of blocks cached under that key
        self._blocks: dict[str, dict[str, Counter[BlockKey]]] = {}
        self._num_groups: dict[str, int] = {}
        #: instance -> hash -> until when it counts as held in the pool (no event yet)
        self._expected: dict[str, dict[bytes, float]] = {}
        self._expiry: deque[tuple[float, str, bytes]] = deque()

    def set_num_groups(self, name: str, num_groups: int) -> None:
        with self._lock:
            self._num_groups[name] = num_groups

    def expect(self, name: str, block_hashes: Sequence[bytes]) -> None:
        """``name`` was sent a prompt with these full blocks: count them as held in its pool."""
        now = time.monotonic()
        until = now + EXPECT_TTL_S
        with self._lock:
            while self._expiry and self._expiry[0][0] <= now:
                _, stale_name, block_hash = self._expiry.popleft()
                expected = self._expected.get(stale_name)
                if expected is not None and expected.get(block_hash, until) <= now:
                    del expected[block_hash]
            expected = self._expected.setdefault(name, {})
            for block_hash in block_hashes:
                expected[block_hash] = until
                self._expiry.append((until, name, block_hash))

    # ------------------------------------------------------------------ the sink
    def apply(self, name: str, events: list[WireEvent]) -> None:
        with self._lock:
            for event in events:
                if isinstance(event, BlockStored | BlockRemoved):
                    medium = normalize_medium(event.medium)
                    blocks = self._blocks.setdefault(name, {}).setdefault(medium, Counter())
                    stored = isinstance(event, BlockStored)
                    change = self._add_locked if stored else self._remove_locked
                    expected = self._expected.get(name, {}) if medium == GPU else {}
                    for block_hash in event.block_hashes:
                        expected.pop(block_hash, None)  # known now: no guess left
                        change(name, medium, blocks, (event.group_idx or 0, block_hash))
                elif isinstance(event, AllBlocksCleared):
                    self._clear_locked(name, GPU)

    def load_snapshot(
        self, name: str, block_hashes: list[list[bytes]], tiers: dict[str, list[list[bytes]]]
    ) -> None:
        """Replace what ``name`` holds: its pool's hashes per group, and each tier's."""
        with self._lock:
            self._clear_locked(name)
            for medium, hashes_by_group in [(GPU, block_hashes), *tiers.items()]:
                medium = normalize_medium(medium)
                blocks = self._blocks.setdefault(name, {}).setdefault(medium, Counter())
                for group, hashes in enumerate(hashes_by_group):
                    for block_hash in hashes:
                        self._add_locked(name, medium, blocks, (group, block_hash))

    def clear(self, name: str) -> None:
        with self._lock:
            self._clear_locked(name)

    def _add_locked(self, name: str, medium: str, blocks: Counter[BlockKey], key: BlockKey) -> None:
        blocks[key] += 1
        if blocks[key] == 1:
            holding = self._holders.setdefault(key[1], {}).setdefault(medium, {})
            holding[name] = holding.get(name, 0) + 1

    def _remove_locked(
        self, name: str, medium: str, blocks: Counter[BlockKey], key: BlockKey
    ) -> None:
        count = blocks.get(key, 0)
        if count == 0:
            return  # stored before this index knew the instance (a partial feed)
        if count > 1:
            blocks[key] = count - 1
            return
        del blocks[key]
        self._unhold_locked(name, medium, key[1])

    def _unhold_locked(self, name: str, medium: str, block_hash: bytes) -> None:
        """One group fewer of ``name`` holds ``block_hash`` in ``medium``."""
        by_medium = self._holders[block_hash]
        holding = by_medium[medium]
        if holding[name] > 1:
            holding[name] -= 1
            return
        del holding[name]
        if not holding:
            del by_medium[medium]
            if not by_medium:
                del self._holders[block_hash]

    def _clear_locked(self, name: str, medium: str | None = None) -> None:
        """Forget what ``name`` holds in ``medium`` (None: everywhere); the pool's expected
        blocks go with the pool."""
        if medium in (None, GPU):
            self._expected.pop(name, None)
        by_medium = self._blocks.get(name, {})
        for cleared in [medium] if medium is not None else list(by_medium):
            for _, block_hash in by_medium.pop(cleared, Counter()):
                self._unhold_locked(name, cleared, block_hash)
        if not by_medium:
            self._blocks.pop(name, None)

    # ------------------------------------------------------------------ queries
    def overlap(
        self,
        block_hashes: Sequence[bytes],
        names: Iterable[str],
        tier_costs: Mapping[str, float] = DEFAULT_TIER_COSTS,
    ) -> dict[str, dict[str, int]]:
        """Per instance, its cached prefix of ``block_hashes`` by tier: the run of them from
        the first that it holds (or is expected to) in some medium, as medium -> number of
        blocks, each block counted at its cheapest medium by ``tier_costs`` ({}: none).

        Set operations per block, not a loop per instance: the instances that hold a block
        in a medium are one intersection; an instance's counts are added up once its medium
        changes (``_Tally``), so a long prefix held alike costs little per instance."""
        now = time.monotonic()
        with self._lock:
            names = list(names)
            groups = {name: self._num_groups.get(name, 1) for name in names}
            if all(g == 1 for g in groups.values()):
                groups = {}  # one group each: held wherever it is listed
            tally = _Tally(names)
            #: Instances with blocks on their way (few: they were routed to lately).
            expecting = {n: self._expected[n] for n in names if self._expected.get(n)}
            left = set(names)
            for block_hash in block_hashes:
                step = self._holding_locked(block_hash, left, groups, expecting, tier_costs, now)
                tally.add(step)
                left = set().union(*step.values())
                if not left:
                    break
            return tally.counts()

    def _holding_locked(
        self,
        block_hash: bytes,
        left: set[str],
        groups: dict[str, int],
        expecting: dict[str, dict[bytes, float]],
        tier_costs: Mapping[str, float],
        now: float,
    ) -> dict[str, frozenset[str]]:
        """Which of the instances ``left`` (consumed) hold ``block_hash`` (every group of
        theirs, per ``groups``, {} when each has one; or expected in the pool), by the cheapest
        medium each holds it in."""
        by_medium = self._holders.get(block_hash, {})
        media = list(by_medium)
        if expecting and GPU not in by_medium:
            media.append(GPU)
        if len(media) > 1:
            media.sort(key=lambda m: (tier_cost(tier_costs, m), m))
        step: dict[str, frozenset[str]] = {}
        for medium in media:
            holding = by_medium.get(medium, {})
            got = left.intersection(holding)
            if groups:
                got = {n for n in got if holding[n] >= groups[n]}
            if medium == GPU:
                got |= {n for n in expecting if n in left and expecting[n].get(block_hash, 0) > now}
            if got:
                step[medium] = frozenset(got)
                left -= got
                if not left:
                    break
        return step

    def num_cached_blocks(self, name: str, medium: str = GPU) -> int:
        """Distinct (group, hash) entries ``name`` caches in ``medium`` (for the pool: its
        ``num_cached_blocks``)."""
        with self._lock:
            return len(self._blocks.get(name, {}).get(medium, ()))

    def cached_blocks_by_medium(self, name: str) -> dict[str, int]:
        """``num_cached_blocks`` of each medium ``name`` has told of (the pool always)."""
        with self._lock:
            by_medium = self._blocks.get(name, {})
            return {GPU: 0} | {medium: len(blocks) for medium, blocks in by_medium.items()}

    def cached(self, name: str, medium: str = GPU) -> Counter[BlockKey]:
        """A copy of ``name``'s mirror of ``medium``: (group, hash) -> number of blocks."""
        with self._lock:
            return Counter(self._blocks.get(name, {}).get(medium, Counter()))


class _Tally:
    """Blocks per instance and medium, added up run by run: consecutive blocks that the same
    instances hold in the same media are one run, counted once per instance."""

    def __init__(self, names: Iterable[str]) -> None:
        self._counts: dict[str, Counter[str]] = {name: Counter() for name in names}
        self._run: dict[str, frozenset[str]] = {}
        self._length = 0

    def add(self, step: dict[str, frozenset[str]]) -> None:
        if step != self._run:
            self._flush()
            self._run = step
        self._length += 1

    def _flush(self) -> None:
        for medium, names in self._run.items():
            for name in names:
                self._counts[name][medium] += self._length
        self._length = 0

    def counts(self) -> dict[str, dict[str, int]]:
        self._flush()
        self._run = {}
        return {name: dict(by_medium) for name, by_medium in self._counts.items()}
