"""ShmAllReduce.close from another thread while a collective waits (one thread per rank in this
process): the waiting call raises at once, and the mapping outlives it."""

from __future__ import annotations

import datetime
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.distributed import FileStore

from pagedkv.distributed.shm_all_reduce import ShmAllReduce


def test_close_from_another_thread_releases_a_waiting_call(tmp_path: Path):
    def meet(rank: int) -> ShmAllReduce | None:
        store = FileStore(str(tmp_path / "store"), 2)
        store.set_timeout(datetime.timedelta(seconds=20))
        return ShmAllReduce.meet(store, rank, 2, 4096, timeout_s=20.0)

    with ThreadPoolExecutor(2) as pool:
        rank0, rank1 = pool.map(meet, range(2))
    if rank0 is None or rank1 is None:
        pytest.skip("no shared-memory path on this machine")
    threading.Timer(0.3, rank0.close).start()  # rank 1 never arrives
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 closed the group"):
        rank0.all_reduce(torch.ones(16))
    assert time.monotonic() - start < 5
    # Rank 0 had published that call before it closed: rank 1's completes; its next can't.
    assert rank1.all_reduce(torch.ones(16)).tolist() == [2.0] * 16
    with pytest.raises(RuntimeError, match="on rank 1: rank 0 closed the group"):
        rank1.all_reduce(torch.ones(16))
    with pytest.raises(RuntimeError, match="closed"):
        rank0.all_reduce(torch.ones(16))
