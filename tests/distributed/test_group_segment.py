"""GroupSegment's meeting, one thread per rank in this process (the segment is reached through
/proc/<pid>/fd just the same): every rank maps it, or none uses it."""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch.distributed import FileStore

from pagedkv.distributed.group_segment import HEADER_BYTES, GroupSegment

SLOT = 4096


def meet_all(tmp_path: Path, usable: list[bool]) -> list[GroupSegment | None]:
    world = len(usable)

    def meet(rank: int) -> GroupSegment | None:
        store = FileStore(str(tmp_path / "store"), world)
        store.set_timeout(datetime.timedelta(seconds=20))
        return GroupSegment.meet(store, rank, world, SLOT, usable[rank])

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(meet, range(world)))


def test_every_rank_maps_the_same_memory(tmp_path: Path):
    segments = meet_all(tmp_path, [True, True, True])
    assert all(segment is not None for segment in segments)
    start = HEADER_BYTES + 5 * SLOT  # rank 2's slot of odd parity
    segments[2].buffer[start : start + 8] = 7
    assert segments[0].buffer[start : start + 8].tolist() == [7] * 8
    assert segments[1].buffer[start - 8 : start].tolist() == [0] * 8
    del segments
    with open("/proc/self/maps") as maps:
        assert "pagedkv-tp" not in maps.read()  # unmapped with the last reference


def test_one_rank_that_cannot_means_gloo_on_every_rank(tmp_path: Path):
    for i, usable in enumerate(([True, False, True], [False, True])):
        (tmp_path / str(i)).mkdir()
        assert meet_all(tmp_path / str(i), usable) == [None] * len(usable)
