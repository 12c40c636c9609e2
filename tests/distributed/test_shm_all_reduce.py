"""TPGroup's collectives between real processes (``tp_rank.py``, one per rank): shared memory
against the rank-order sum, bit for bit on every rank; against gloo; a rank killed mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.tp_rank import KILL_AT

ROOT = Path(__file__).resolve().parents[2]
RANK_SCRIPT = Path(__file__).with_name("tp_rank.py")
SLOT = 64 << 10  # small slots: the larger cases go in several chunks


def run_group(directory: Path, world: int, *args: str, timeout_s: float = 60) -> list[dict]:
    """Every rank's result (None for a rank killed by SIGKILL)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), str(directory), str(rank), str(world), *args],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        stderr = [proc.communicate(timeout=timeout_s)[1] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for rank, proc in enumerate(procs):
        if proc.returncode == -signal.SIGKILL:
            results.append(None)
            continue
        assert proc.returncode == 0, stderr[rank][-2000:]  # also: no abort at exit
        results.append(json.loads((directory / f"result-{rank}.json").read_text()))
    return results


def left_behind(directory: Path) -> set[str]:
    """The files in a group's directory, but the test's own."""
    return {p.name for p in directory.iterdir() if not p.name.startswith(("ready-", "result-"))}


def check_cases(results: list[dict]) -> None:
    """Every rank got the exact results, the same bits as every other rank."""
    for rank, result in enumerate(results):
        assert result["errors"] == [], f"rank {rank} got other sums than the rank-order sum"
    assert len({result["digest"] for result in results}) == 1, "the ranks got other bits"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_random_cases_equal_the_rank_order_sum_on_every_rank(tmp_path: Path, world: int):
    """fp32/bf16/fp16 all-reduces and gathers (also int64), 1 element to 3 slots' worth, some
    of them column-major: the exact rank-order sum (fp32, rounded once), the same bits on every
    rank; each rank's gathered tensor exactly on rank 0."""
    results = run_group(tmp_path, world, "cases", "--seed", str(world), "--slot", str(SLOT))
    assert all(result["shm"] for result in results)
    check_cases(results)


def test_a_tensor_larger_than_the_default_slot(tmp_path: Path):
    """The default 4 MiB slots: a tensor of up to 8 MiB goes in chunks."""
    args = ("--seed", "7", "--slot", str(4 << 20), "--cases", "6", "--max-bytes", str(6 << 20))
    check_cases(run_group(tmp_path, 2, "cases", *args))


@pytest.mark.parametrize("world", [2, 4])
def test_hundreds_of_back_to_back_calls_with_skewed_ranks(tmp_path: Path, world: int):
    """400 small collectives, some ranks napping before some calls: a fast rank reuses its
    slot of the same parity two calls later while slow ones may still be on the last one."""
    args = ("--seed", "11", "--slot", str(SLOT), "--cases", "400", "--max-bytes", "4096")
    check_cases(run_group(tmp_path, world, "cases", *args, "--skew"))


def test_gloo_fallback_gives_the_same_results(tmp_path: Path):
    """The same cases through shared memory, then through the group's gloo, on integer-valued
    inputs (exact in any order of addition): the same bits. (On other inputs gloo's ring adds
    in its own order: the same bits on every rank, but not the rank-order sum.)"""
    args = ("--seed", "5", "--slot", str(SLOT), "--integers", "--cases", "60", "--also-gloo")
    results = run_group(tmp_path, 3, "cases", *args)
    check_cases(results)
    check_cases([result["gloo"] for result in results])
    assert results[0]["gloo"]["digest"] == results[0]["digest"]


def test_segment_leaves_nothing_behind(tmp_path: Path):
    """The segment never has a name (memfd): after the meeting the group's directory holds only
    (at most) the store, and a rank's only descriptors on the segment are anonymous (mmap's own)."""
    before = set(os.listdir("/dev/shm"))
    results = run_group(tmp_path, 2, "cases", "--cases", "3")
    assert left_behind(tmp_path) <= {"store"}
    for result in results:
        assert result["mapped"]
        assert all(link.startswith("/memfd:pagedkv-tp") for link in result["segment_fds"])
    assert set(os.listdir("/dev/shm")) <= before


@pytest.mark.parametrize("killed", [0, 2])
def test_a_killed_rank_makes_the_others_raise_within_the_timeout(tmp_path: Path, killed: int):
    """Rank ``killed`` SIGKILLs itself before its 51st all-reduce: every other rank's 51st
    raises a RuntimeError naming it within the timeout (3 s), and the next call at once; the
    killed rank leaves no file behind."""
    start = time.monotonic()
    args = ("kill", "--kill-rank", str(killed), "--timeout", "3")
    results = run_group(tmp_path, 3, *args)
    assert results[killed] is None
    for rank, result in enumerate(results):
        if rank == killed:
            continue
        assert result["shm"]
        assert result["raised_at"] == KILL_AT
        assert f"rank {killed} did not arrive within 3 s" in result["raised"]
        assert result["wait_s"] < 3 + 1.5
        assert result["again_s"] < 0.5 and "closed" in result["raised_again"]
    assert time.monotonic() - start < 40
    assert left_behind(tmp_path) <= {"store"}
