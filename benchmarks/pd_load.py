#!/usr/bin/env python
"""1P1D under load on one host, P and D pinned to disjoint cores against unpinned.

A small random Llama (the hf_peer anchor's: 19M parameters, 4 layers, fp32) as a P and a D
(P2P connector, PUT_ASYNC) behind ``pagedkv proxy``; ``pagedkv bench serve`` runs 64 streaming
clients through the proxy for 60 s, each sending its next request as soon as its last one
ended, every prompt fresh (random token ids: each moves its whole KV from P to D). Per mode
(fresh processes each): requests/s, output tokens/s, TTFT p50/p99, ITL p50, failed requests,
and whether P and D came back to rest (``--check-metrics``). The load generator's summary and
JSON stay in the run's log directory.

In a closed loop a client's cycle is fixed by the throughput (64 / requests per second), so
TTFT shows where the queue forms (at P: long TTFT, short ITL) more than how fast one prompt is.

    python benchmarks/pd_load.py                          # pinned and unpinned, 60 s each
    python benchmarks/pd_load.py --duration 10 --clients 16   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.pd_instances import (  # noqa: E402
    MODES,
    VOCAB_SIZE,
    PDSetup,
    Processes,
    add_deployment_args,
    build_small_llama,
    kv_paths,
    load_average,
    machine_info,
    mode_pinnings,
    parse_modes,
    start_1p1d,
)


class LoadRow(NamedTuple):
    """One mode's run, from ``bench serve``'s JSON summary."""

    mode: str
    completed: int
    failed: int
    request_throughput: float
    output_throughput: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    at_rest: bool


def bench_serve_argv(proxy: str, args: argparse.Namespace, check: list[str], out: Path) -> list:
    """The ``pagedkv bench serve`` command line of one run."""
    return [
        sys.executable, "-m", "pagedkv", "bench", "serve",
        "--base-url", proxy,
        "--duration", str(args.duration),
        "--max-concurrency", str(args.clients),
        "--input-len", str(args.input_len),
        "--output-len", str(args.output_len),
        "--vocab-size", str(VOCAB_SIZE),
        "--seed", str(args.seed),
        "--check-metrics", *check,
        "--result-json", str(out),
        "--disable-tqdm",
    ]  # fmt: skip


def parse_summary(mode: str, result_json: Path) -> LoadRow:
    """A run's row from ``bench serve --result-json``."""
    summary = json.loads(result_json.read_text())["summary"]
    ttft = summary["ttft"]
    return LoadRow(
        mode,
        summary["completed"],
        summary["failed"],
        summary["request_throughput"],
        summary["output_throughput"],
        ttft.get("p50_ms", float("nan")),
        ttft.get("p99_ms", float("nan")),
        summary["itl"].get("p50_ms", float("nan")),
        all(summary.get("instances", {}).values()),
    )


def run_mode(model: Path, mode: str, args: argparse.Namespace) -> LoadRow:
    """Start a 1P1D deployment pinned as ``mode`` says, load it through the proxy, stop it."""
    p_pin, d_pin = mode_pinnings(mode)
    print(f"  {mode}: P {p_pin.how}; D {d_pin.how}; load before {load_average()}", flush=True)
    max_len = args.input_len + args.output_len + 64
    serve_args = [str(model), "--max-model-len", str(max_len), "--log-level", "warning"]
    log_dir = Path(tempfile.mkdtemp(prefix=f"pd_load_{mode}_"))
    procs = Processes(log_dir)
    try:
        proxy, instances = start_1p1d(
            procs, serve_args, PDSetup(args.send_type, args.transport), p_pin, d_pin
        )
        out = log_dir / "bench_serve.json"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with (log_dir / "bench_serve.log").open("w") as log:
            argv = bench_serve_argv(proxy, args, instances, out)
            subprocess.run(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        if not out.exists():
            raise RuntimeError(f"bench serve wrote no results: see {log_dir / 'bench_serve.log'}")
        row = parse_summary(mode, out)
        print(f"    KV paths: {kv_paths(proxy)}", flush=True)
    finally:
        procs.stop()
    print(
        f"    {row.request_throughput:7.2f} req/s   {row.output_throughput:8.1f} output tok/s   "
        f"TTFT p50 {row.ttft_p50_ms:8.1f} ms   p99 {row.ttft_p99_ms:8.1f} ms   "
        f"ITL p50 {row.itl_p50_ms:6.1f} ms   "
        f"{row.completed} ok, {row.failed} failed, instances at rest: {row.at_rest}   "
        f"(load after {load_average()}; logs: {log_dir})",
        flush=True,
    )
    return row


def print_ratios(rows: list[LoadRow]) -> None:
    """Pinned against unpinned, when both ran."""
    by_mode = {row.mode: row for row in rows}
    if set(by_mode) != set(MODES):
        return
    pinned, unpinned = by_mode["pinned"], by_mode["unpinned"]
    print(
        f"pinned / unpinned: throughput {pinned.output_throughput / unpinned.output_throughput:.2f}"
        f"x, TTFT p50 {pinned.ttft_p50_ms / unpinned.ttft_p50_ms:.2f}x, "
        f"p99 {pinned.ttft_p99_ms / unpinned.ttft_p99_ms:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load per mode")
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients")
    ap.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens")
    ap.add_argument("--seed", type=int, default=0)
    add_deployment_args(ap)
    args = ap.parse_args()
    modes = parse_modes(ap, args.modes)
    print(f"machine: {machine_info()}")
    print(
        f"1P1D {args.send_type} (same_host_transport: {args.transport or 'default'}) behind the "
        f"proxy, {args.clients} clients for {args.duration:g} s, {args.input_len}-token prompts, "
        f"{args.output_len} output tokens, small Llama (19M, fp32)"
    )
    with tempfile.TemporaryDirectory(prefix="pd_load_model_") as tmp:
        model = Path(tmp) / "model"
        build_small_llama(model, max_positions=max(4096, args.input_len + args.output_len + 64))
        rows = [run_mode(model, mode, args) for mode in modes]
    print_ratios(rows)


if __name__ == "__main__":
    main()
