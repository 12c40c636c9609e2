#!/usr/bin/env python
"""Prefill/decode KV transfer on one host: every data path against its peers, in one run.

The KV of one prompt (32 layers, 8 KV heads, head size 128, fp16 = 128 KiB per token, blocks
of 16 tokens placed "contiguous", in "runs" of 16, or at "random" in the cache on each side)
moved from a P process to a D process (pd_transfer_peer.py), 1k-16k tokens. Per prompt length,
GB/s (the bytes over the median time from the first side starting to D holding the last
byte) of:
  shm        the P2P lanes over the same-host shared-memory path (P gathers the blocks, D
             scatters them into its paged cache), as the connector moves KV
  gloo       the P2P lanes over the network path (a 2-rank gloo group on loopback; D cuts
             the messages where its block ids break around runs long enough to be received
             in place, P packs and D scatters the others with the compiled block copy)
  gloo-raw   the same messages over gloo with no gather on P and no scatter on D
  TCP        the same bytes over a raw loopback TCP socket (sendall / recv_into, contiguous)
  memcpy     one copy of the same bytes in one process (``Tensor.copy_`` of a contiguous
             buffer into another, cache-cold), on 1 thread (the ceiling of the ratio) and on
             the threads of both sides together (2 x ``--threads``)
and the ratios shm / memcpy (target >= 0.5, every placement) and gloo / TCP (target >= 0.7
for scattered blocks). Each side uses ``--threads`` torch threads (default: half the cores).
Medians over repeats, the first a warm-up; the machine's load is printed per placement.

    python benchmarks/pd_transfer.py --markdown          # 1k-16k tokens, 3 placements (~6 min)
    python benchmarks/pd_transfer.py --quick             # 1k and 4k tokens, fewer repeats
    python benchmarks/pd_transfer.py --tokens 1024,8192 --placement random --paths gloo,tcp
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.pd_instances import free_port, load_average, machine_info  # noqa: E402
from benchmarks.pd_transfer_peer import (  # noqa: E402
    BLOCK_SIZE,
    BYTES_PER_TOKEN,
    HEAD_SIZE,
    LANE_OPS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    PLACEMENTS,
    RUN_BLOCKS,
    run_peer,
)

PATHS = ("shm", "gloo", "gloo-raw", "tcp", "shm-raw")
SHM_OVER_MEMCPY, GLOO_OVER_TCP = 0.5, 0.7
#: Written over between timed copies so that neither buffer starts in the cache.
SCRUB_BYTES = 256 << 20


class MemcpyCeiling:
    """One contiguous ``copy_`` of ``total_bytes`` in this process, cache-cold: the source
    and destination are written over by a scrub buffer before each timed copy."""

    def __init__(self, total_bytes: int) -> None:
        self.src = torch.ones(total_bytes, dtype=torch.uint8)
        self.dst = torch.zeros_like(self.src)  # touched: no page faults in the timed copies
        self.scrub = torch.empty(SCRUB_BYTES, dtype=torch.uint8)

    def time_once(self, threads: int) -> float:
        """Seconds for one copy on ``threads`` threads."""
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            self.scrub.fill_(1)
            t0 = time.perf_counter()
            self.dst.copy_(self.src)
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(before)


class Row(NamedTuple):
    """One prompt length of one placement: GB/s per path (and memcpy on 1 and N threads)."""

    placement: str
    tokens: int
    gbps: dict[str, float]

    def ratio(self, num: str, den: str) -> float | None:
        if num not in self.gbps or den not in self.gbps:
            return None
        return self.gbps[num] / self.gbps[den]


class Peers:
    """The P and D processes and the pipes to them."""

    def __init__(self, args: dict) -> None:
        self.placement = args["placement"]
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = {}, []
        for role in ("P", "D"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=run_peer, args=(role, child, args), daemon=True)
            proc.start()
            self.pipes[role] = parent
            self.procs.append(proc)
        for role in ("P", "D"):
            self.ask(role)

    def ask(self, role: str, message: dict | None = None, timeout: float = 600) -> dict:
        if message is not None:
            self.pipes[role].send(json.dumps(message))
        if not self.pipes[role].poll(timeout):
            raise TimeoutError(f"{role} did not answer in {timeout:g} s")
        answer = json.loads(self.pipes[role].recv())
        if "error" in answer:
            raise RuntimeError(f"{role}: {answer['error']}")
        return answer

    def connect(self) -> dict[str, str]:
        """Set up every data path; D's kind of wire per path."""
        for role in ("D", "P"):
            self.pipes[role].send(json.dumps({"op": "connect"}))
        self.ask("P")
        return self.ask("D")["kinds"]

    def time_once(self, op: str, num_blocks: int, seed: int) -> float:
        """One transfer: seconds from the first side starting to D ending."""
        command = {"op": op, "num_blocks": num_blocks, "seed": seed}
        for role in ("D", "P"):
            self.ask(role, command)
        for role in ("D", "P"):
            self.pipes[role].send(json.dumps({"go": True}))
        d, p = self.ask("D"), self.ask("P")
        if d["check"] is False:
            raise AssertionError(f"{op}: D's blocks do not hold P's KV")
        return d["t1"] - min(d["t0"], p["t0"])

    def close(self) -> None:
        for pipe in self.pipes.values():
            with contextlib.suppress(OSError):
                pipe.send(json.dumps({"op": "stop"}))
        for proc in self.procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()


def peer_args(tokens: list[int], placement: str, paths: list[str], opts: argparse.Namespace):
    """What both sides need: ports, cache size, message and window sizes."""
    lane_paths = sorted({LANE_OPS[p][0] for p in paths if p in LANE_OPS})
    return {
        "placement": placement,
        "paths": lane_paths,
        "ports": {path: {"P": free_port(), "D": free_port()} for path in lane_paths},
        "tcp_port": free_port(),
        # Room for the largest prompt (in runs, and with slack to place it contiguously).
        "max_blocks": -(-max(tokens) // BLOCK_SIZE // RUN_BLOCKS) * RUN_BLOCKS * 5 // 4,
        "chunk_bytes": int(opts.chunk_mib * 2**20),
        "in_flight_bytes": int(opts.in_flight_mib * 2**20),
        "threads": opts.threads,
    }


def run_placement(
    placement: str, tokens: list[int], paths: list[str], opts: argparse.Namespace
) -> list[Row]:
    """Every path at every prompt length for one placement, in one pair of processes."""
    peers = Peers(peer_args(tokens, placement, paths, opts))
    rows = []
    try:
        kinds = peers.connect()
        for path, (stack, _) in LANE_OPS.items():
            wanted = "gloo" if stack == "network" else stack
            if path in paths and kinds[stack].split()[0] != wanted:
                print(f"    note: {path} ran over {kinds[stack]!r}, not {wanted!r}")
        for n_tokens in tokens:
            rows.append(time_prompt(peers, n_tokens, paths, opts))
            print_row(rows[-1], paths, 2 * opts.threads)
    finally:
        peers.close()
    return rows


def time_prompt(peers: Peers, n_tokens: int, paths: list[str], opts: argparse.Namespace) -> Row:
    """Every path, and memcpy on 1 and on both sides' threads, taking turns within each
    repeat (so that a change in the machine's load falls on all of them); medians."""
    total = n_tokens * BYTES_PER_TOKEN
    ceiling = MemcpyCeiling(total)
    copies = {"memcpy": 1, "memcpy-N": 2 * opts.threads}
    times: dict[str, list[float]] = {path: [] for path in [*paths, *copies]}
    for rep in range(opts.repeats + 1):  # the first is a warm-up (page faults, buffers)
        for path in paths:
            elapsed = peers.time_once(path, n_tokens // BLOCK_SIZE, rep)
            if rep:
                times[path].append(elapsed)
        for name, threads in copies.items():
            elapsed = ceiling.time_once(threads)
            if rep:
                times[name].append(elapsed)
    return Row(
        placement=peers.placement,
        tokens=n_tokens,
        gbps={path: total / statistics.median(t) / 1e9 for path, t in times.items()},
    )


def print_row(row: Row, paths: list[str], threads: int) -> None:
    """One prompt length: GB/s of every path, then the ratios."""
    cells = [f"{p} {row.gbps[p]:5.2f}" for p in paths]
    cells += [f"memcpy 1t {row.gbps['memcpy']:5.2f}", f"{threads}t {row.gbps['memcpy-N']:5.2f}"]
    ratios = [("shm/memcpy", "shm", "memcpy"), (f"shm/memcpy-{threads}t", "shm", "memcpy-N")]
    ratios += [("gloo/TCP", "gloo", "tcp"), ("gloo-raw/TCP", "gloo-raw", "tcp")]
    shown = [f"{name} {r:4.2f}" for name, a, b in ratios if (r := row.ratio(a, b)) is not None]
    print(
        f"  {row.tokens:6d} tok {row.tokens * BYTES_PER_TOKEN / 2**20:6.0f} MiB  GB/s: "
        f"{'  '.join(cells)}  |  {'  '.join(shown)}   (load {load_average()})",
        flush=True,
    )


def print_verdicts(rows: list[Row]) -> None:
    """Each target's range of ratios over the rows, and whether every row meets it."""
    checks = [("shm", "memcpy", SHM_OVER_MEMCPY, PLACEMENTS)]
    checks.append(("gloo", "tcp", GLOO_OVER_TCP, ("random", "runs")))
    for num, den, target, placements in checks:
        for placement in placements:
            ratios = [
                r
                for row in rows
                if row.placement == placement and (r := row.ratio(num, den)) is not None
            ]
            if ratios:
                met = "met" if min(ratios) >= target else "NOT met"
                print(
                    f"target {num}/{den} >= {target} ({placement}): "
                    f"{min(ratios):.2f}-{max(ratios):.2f} ({met})"
                )


def print_markdown(rows: list[Row], paths: list[str], threads: int) -> None:
    """The rows as a Markdown table, for docs/benchmarks.md."""
    columns = [*paths, "memcpy", "memcpy-N"]
    names = [*paths, "memcpy 1t", f"memcpy {threads}t"]
    print("GB/s of each path, ratios in bold:")
    print(f"| placement | tokens | {' | '.join(names)} | shm / memcpy | gloo / TCP |")
    print("|---" * (len(names) + 4) + "|")
    for row in rows:
        rates = " | ".join(f"{row.gbps[c]:.2f}" for c in columns)
        ratios = [row.ratio("shm", "memcpy"), row.ratio("gloo", "tcp")]
        shown = " | ".join("" if r is None else f"**{r:.2f}**" for r in ratios)
        print(f"| {row.placement} | {row.tokens} | {rates} | {shown} |")


def parse_args() -> tuple[argparse.Namespace, list[int], list[str], list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1k and 4k tokens, 3 repeats")
    ap.add_argument("--tokens", default=None, help="prompt lengths, e.g. 1024,16384")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--chunk-mib", type=float, default=8, help="max message size, MiB")
    ap.add_argument("--in-flight-mib", type=float, default=32, help="bytes in flight each way")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--placement", default=",".join(PLACEMENTS), help=f"of {PLACEMENTS}")
    ap.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    ap.add_argument("--paths", default="shm,gloo,gloo-raw,tcp", help=f"of {PATHS}")
    opts = ap.parse_args()
    opts.repeats = opts.repeats or (3 if opts.quick else 5)
    default = [1024, 4096] if opts.quick else [1024, 2048, 4096, 8192, 16384]
    tokens = [int(t) for t in opts.tokens.split(",")] if opts.tokens else default
    placements, paths = opts.placement.split(","), opts.paths.split(",")
    if bad := [p for p in placements if p not in PLACEMENTS]:
        ap.error(f"--placement: {bad} not in {PLACEMENTS}")
    if bad := [p for p in paths if p not in PATHS]:
        ap.error(f"--paths: {bad} not in {PATHS}")
    return opts, tokens, placements, paths


def main() -> None:
    opts, tokens, placements, paths = parse_args()
    print(f"machine: {machine_info()}")
    rows = []
    for placement in placements:
        print(
            f"KV P -> D, {NUM_LAYERS} layers x {NUM_KV_HEADS} KV heads x {HEAD_SIZE} x fp16 "
            f"({BYTES_PER_TOKEN // 1024} KiB/token), blocks of {BLOCK_SIZE} placed {placement}, "
            f"messages <= {opts.chunk_mib:g} MiB, {opts.in_flight_mib:g} MiB in flight, "
            f"{opts.threads} threads a side, median of {opts.repeats}; load {load_average()}",
            flush=True,
        )
        rows += run_placement(placement, tokens, paths, opts)
    print_verdicts(rows)
    if opts.markdown:
        print_markdown(rows, paths, 2 * opts.threads)


if __name__ == "__main__":
    main()
