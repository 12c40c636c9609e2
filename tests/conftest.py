"""Collection order for the two xdist workers (``--dist loadfile --no-loadscope-reorder`` hands
out files in collection order): the longest files first, so that neither worker is left alone
with one at the end. (xdist's default order, most tests first, ran the two-test README file last:
four minutes with one worker idle.)"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pytest

# Seconds each took in a full run on the 2-core CI machine (longest first).
LONGEST_FIRST = (
    "tests/entrypoints/test_documented_commands.py",  # 230
    "tests/kv_transfer/test_pd_1p1d.py",  # 115
    "tests/kv_transfer/test_p2p_engines.py",  # 70
    "tests/kv_transfer/test_p2p_lifecycle.py",  # 65
    "tests/kv_transfer/test_pd_lifecycle.py",  # 60
    "tests/kv_transfer/test_pd_churn.py",  # 57
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))


@pytest.fixture(autouse=True)
def _restore_cpu_affinity() -> Iterator[None]:
    """An engine built in a test's own process pins that process (``cpu_cores``, or a
    tensor-parallel rank 0's share of the cores) for good: give it back its cores and torch
    threads after each test, or later tests and the processes they start inherit one core."""
    cores = os.sched_getaffinity(0)
    yield
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(int(task), cores)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(len(cores))
