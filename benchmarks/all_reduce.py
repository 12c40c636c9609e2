#!/usr/bin/env python
"""Tensor-parallel all-reduce latency between two ranks on this host: shared memory (TPGroup's
path, ``pagedkv/distributed/shm_all_reduce.py``) against gloo on loopback (its fallback).

Two rank processes meet through ``init_tp_group`` and, for each size, run ``--calls``
back-to-back fp32 all-reduces on each path (after a warm-up), timing each call on rank 0; the
table shows the median in microseconds and gloo/shm. The whole run is done twice: the ranks
left to the scheduler, then pinned one per core (``os.sched_setaffinity``). The share of the
CPU other processes used in the second before each run is printed: a busy machine's figures
are noisy.

    python benchmarks/all_reduce.py
    python benchmarks/all_reduce.py --calls 5000 --sizes 4096 65536
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.distributed import ReduceOp  # noqa: E402

from benchmarks.pd_instances import machine_info  # noqa: E402
from benchmarks.quiet_machine import OthersMeter  # noqa: E402
from pagedkv.distributed.tp_group import TPGroup, init_tp_group  # noqa: E402

SIZES = (4 << 10, 16 << 10, 256 << 10, 4 << 20)
WARM_UP = 50


def _time_calls(group: TPGroup, path: str, x: torch.Tensor, calls: int) -> float:
    """Median microseconds of one all-reduce of ``x`` on ``path`` ("shm" or "gloo")."""
    assert group.shm is not None and group.pg is not None
    shm, pg = group.shm, group.pg
    times = []
    for call in range(WARM_UP + calls):
        start = time.perf_counter_ns()
        if path == "shm":
            shm.all_reduce(x)
        else:
            pg.allreduce([x], ReduceOp.SUM).wait()
        if call >= WARM_UP:
            times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def run_rank(rank: int, directory: str, pinned: bool, sizes: list[int], calls: int) -> None:
    """One rank's measurements; rank 0 writes them to ``<directory>/result.json``."""
    torch.set_num_threads(1)
    if pinned:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    group = init_tp_group(rank, 2, f"{directory}/store", 60.0)
    if group.shm is None:
        raise SystemExit("no shared-memory path on this machine (see the log)")
    rows = []
    for size in sizes:
        x = torch.zeros(size // 4)  # zeros: every call adds the same values (no inf, no denormal)
        n = calls if size <= (256 << 10) else max(50, calls // 20)
        rows.append([size, _time_calls(group, "shm", x, n), _time_calls(group, "gloo", x, n)])
    group.close()
    if rank == 0:
        Path(directory, "result.json").write_text(json.dumps(rows))


def run_pair(pinned: bool, sizes: list[int], calls: int) -> tuple[list[list[float]], float]:
    """Both ranks' run: rank 0's rows (size, shm us, gloo us), and the CPU share others used
    in the second before it."""
    with OthersMeter() as meter:
        time.sleep(1.0)
    with tempfile.TemporaryDirectory() as directory:
        argv = [sys.executable, __file__, "--dir", directory, "--calls", str(calls)]
        argv += ["--sizes", *map(str, sizes), *(["--pinned"] if pinned else [])]
        procs = [subprocess.Popen([*argv, "--rank", str(rank)]) for rank in (0, 1)]
        if any(proc.wait(timeout=600) for proc in procs):
            raise SystemExit("a rank failed")
        rows = json.loads(Path(directory, "result.json").read_text())
    return rows, meter.share


def _size(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="bytes")
    parser.add_argument("--calls", type=int, default=2000, help="per size (4 MiB: / 20)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--pinned", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        run_rank(args.rank, args.dir, args.pinned, args.sizes, args.calls)
        return
    print(machine_info())
    print("two ranks, fp32 all-reduce, median us per call\n")
    print(f"{'':10}{'unpinned':^30}{'pinned (one core each)':^30}")
    print(f"{'size':>8}  " + f"{'shm':>9}{'gloo':>10}{'gloo/shm':>11}" * 2)
    runs = [run_pair(pinned, args.sizes, args.calls) for pinned in (False, True)]
    for i, size in enumerate(args.sizes):
        cells = "".join(
            f"{rows[i][1]:9.1f}{rows[i][2]:10.1f}{rows[i][2] / rows[i][1]:10.1f}x"
            for rows, _ in runs
        )
        print(f"{_size(size):>8}  {cells}")
    print(f"\nothers' share of the CPU before each run: {runs[0][1]:.0%}, {runs[1][1]:.0%}")


if __name__ == "__main__":
    main()
