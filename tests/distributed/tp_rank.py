"""One rank of a test's tensor-parallel group (a separate process): meets the others, runs a
scenario of collectives and writes what it saw to ``<dir>/result-<rank>.json``.

Every rank draws the same cases from the shared seed and can make any rank's input (seeded by
case and rank), so each checks its own results against the rank-order sum exactly; the digest of
all its results lets the test check that every rank got the same bits.

    python tests/distributed/tp_rank.py DIR RANK WORLD SCENARIO [--seed N] [--slot BYTES|gloo] ...
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedkv.distributed.tp_group import TPGroup, init_tp_group  # noqa: E402

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
#: Calls before the killed rank kills itself, in the "kill" scenario.
KILL_AT = 50


def make_input(
    seed: int, case: int, rank: int, shape: list[int], dtype: torch.dtype, integers: bool
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + case * 101 + rank)
    if integers or not dtype.is_floating_point:
        return torch.randint(-8, 9, shape, generator=generator).to(dtype)
    return torch.randn(shape, generator=generator).to(dtype)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1).view(torch.uint8)


def rank_order_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """((x_0 + x_1) + x_2) + ... in fp32, rounded once to the inputs' dtype."""
    acc = inputs[0].float().clone()
    for x in inputs[1:]:
        acc += x.float()
    return acc.to(inputs[0].dtype)


def draw_case(rng: random.Random, max_bytes: int) -> tuple[str, list[int], torch.dtype]:
    op = rng.choice(("all_reduce", "all_reduce", "gather"))
    dtype = rng.choice(FLOATS + ((torch.int64,) if op == "gather" else ()))
    numel = max(1, int(2 ** rng.uniform(0, max_bytes.bit_length() + 1)) // dtype.itemsize)
    if rng.random() < 0.3 and numel >= 4:  # two dims: sometimes given transposed (non-contiguous)
        rows = rng.randint(2, 8)
        return op, [rows, max(1, numel // rows)], dtype
    return op, [numel], dtype


def run_case(
    group: TPGroup,
    args: argparse.Namespace,
    case: int,
    op: str,
    shape: list[int],
    dtype: torch.dtype,
) -> tuple[bytes, bool]:
    """(this rank's result bytes, whether they are the exact expected values)."""
    inputs = [
        make_input(args.seed, case, r, shape, dtype, args.integers) for r in range(group.world_size)
    ]
    x = inputs[group.rank].clone()
    if len(shape) == 2 and case % 2:
        x = x.t().contiguous().t()  # same values, column-major
    if op == "all_reduce":
        result = group.all_reduce(x)
        got = as_bytes(result)
        return got.numpy().tobytes(), result is x and torch.equal(
            got, as_bytes(rank_order_sum(inputs))
        )
    gathered = group.gather(x)
    if group.rank != 0:
        return b"", gathered is None
    ok = all(torch.equal(as_bytes(g), as_bytes(i)) for g, i in zip(gathered, inputs))
    return b"".join(as_bytes(g).numpy().tobytes() for g in gathered), ok


def scenario_cases(group: TPGroup, args: argparse.Namespace) -> dict:
    """The digest of this rank's all-reduce results and the cases it got wrong."""
    rng = random.Random(args.seed)
    digest = hashlib.sha256()
    errors = []
    for case in range(args.cases):
        op, shape, dtype = draw_case(rng, args.max_bytes)
        if args.skew and random.Random(case * 7 + group.rank).random() < 0.2:
            time.sleep(random.Random(case).random() * 2e-4)
        data, ok = run_case(group, args, case, op, shape, dtype)
        if op == "all_reduce":
            digest.update(data)
        if not ok:
            errors.append(f"case {case}: {op} {shape} {dtype}")
    return {"digest": digest.hexdigest(), "errors": errors}


def scenario_kill(group: TPGroup, args: argparse.Namespace, result: dict) -> None:
    x = torch.ones(1024)
    for call in range(KILL_AT + 1):
        if call == KILL_AT and group.rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            group.all_reduce(x.fill_(1.0))
        except RuntimeError as e:
            result["raised"] = str(e)
            result["raised_at"] = call
            result["wait_s"] = time.monotonic() - start
            break
    start = time.monotonic()
    try:
        group.all_reduce(x)
    except RuntimeError as e:
        result["raised_again"] = str(e)
        result["again_s"] = time.monotonic() - start


def segment_fds() -> list[str]:
    """What this process's descriptors on a group segment point to."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listdir itself had open
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [link for link in links if "pagedkv-tp" in link]


def meet(args: argparse.Namespace) -> TPGroup:
    """Wait for every rank's process to be up (so the meeting's timeout measures the meeting,
    not python's start), then meet."""
    directory = Path(args.dir)
    (directory / f"ready-{args.rank}").touch()
    deadline = time.monotonic() + 120
    while not all((directory / f"ready-{r}").exists() for r in range(args.world)):
        if time.monotonic() > deadline:
            raise TimeoutError("the other ranks never started")
        time.sleep(0.01)
    slot = None if args.slot == "gloo" else int(args.slot)
    return init_tp_group(args.rank, args.world, str(directory / "store"), args.timeout, slot)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("scenario", choices=("cases", "kill"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slot", default=str(64 << 10))
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--max-bytes", type=int, default=200 << 10)
    parser.add_argument("--integers", action="store_true")
    parser.add_argument("--skew", action="store_true")
    parser.add_argument("--also-gloo", action="store_true")
    parser.add_argument("--kill-rank", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    group = meet(args)
    result: dict = {"shm": group.shm is not None, "segment_fds": segment_fds()}
    with open("/proc/self/maps") as maps:
        result["mapped"] = "pagedkv-tp" in maps.read()
    if args.scenario == "cases":
        result.update(scenario_cases(group, args))
        if args.also_gloo:  # the same cases again, through the same group's gloo
            result["gloo"] = scenario_cases(TPGroup(group.rank, group.world_size, group.pg), args)
    else:
        scenario_kill(group, args, result)
    group.close()
    Path(args.dir, f"result-{args.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
