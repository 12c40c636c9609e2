#!/usr/bin/env python
"""1P1D TTFT against one instance, on one host: what disaggregation costs a prompt.

A small random Llama (the hf_peer anchor's: 19M parameters, 4 layers, fp32) served two ways in
one run: one plain ``pagedkv serve``, then (once it is stopped) a P and a D (P2P connector,
PUT_ASYNC by default) behind ``pagedkv proxy``: with both alive, the idle one slowed the other
in shared runs. Prompts of each length (256, 2k and 8k tokens by default) are token ids, each
distinct (no prefix reuse), with max_tokens=1 so a request's latency is its TTFT; one request
at a time, after a warm-up. Medians.

Two modes, each with its own fresh processes:
  pinned    P and D on disjoint halves of the cores, the single instance on P's half (the
            same compute for the prompt; P logs that it shares cores with it: they never
            compute at once); see pd_instances.py for how.
  unpinned  every instance free to use every core with its default threads.

Target: 1P1D within +10 % of one instance at 2k tokens, pinned. The machine's load is printed
before and after each mode.

    python benchmarks/pd_ttft.py                         # pinned and unpinned, 256/2k/8k
    python benchmarks/pd_ttft.py --quick                 # 256 and 2k tokens, 3 repeats
    python benchmarks/pd_ttft.py --modes pinned --transport network   # the gloo path
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.pd_instances import (  # noqa: E402
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
    start_single,
    time_request,
)

TARGET_TOKENS, TARGET_OVERHEAD = 2048, 0.10


class TTFTRow(NamedTuple):
    """Median TTFT of one prompt length, in seconds, and the repeats taken."""

    mode: str
    prompt_len: int
    single_s: float
    pd_s: float
    repeats: int

    @property
    def overhead(self) -> float:
        return self.pd_s / self.single_s - 1


def medians(url: str, prompt_len: int, repeats: int, gen: torch.Generator) -> float:
    """Median seconds of ``repeats`` requests to one deployment, after a warm-up."""
    import httpx

    times = []
    with httpx.Client(timeout=600) as client:
        for rep in range(repeats + 1):
            prompt = torch.randint(10, VOCAB_SIZE, (prompt_len,), generator=gen).tolist()
            elapsed = time_request(client, url, prompt)
            if rep:
                times.append(elapsed)
    return statistics.median(times)


def run_mode(
    model: Path, mode: str, lengths: list[int], repeats: dict[int, int], setup: PDSetup
) -> list[TTFTRow]:
    """Start a single instance and a 1P1D deployment pinned as ``mode`` says, time every
    prompt length, stop them."""
    p_pin, d_pin = mode_pinnings(mode)
    single_pin = p_pin
    print(
        f"  {mode}: single {single_pin.how}; P {p_pin.how}; D {d_pin.how}; "
        f"load before {load_average()}",
        flush=True,
    )
    max_len = max(lengths) + 64
    serve_args = [str(model), "--max-model-len", str(max_len), "--log-level", "warning"]
    log_dir = Path(tempfile.mkdtemp(prefix=f"pd_ttft_{mode}_"))
    procs = Processes(log_dir)
    seconds: dict[str, dict[int, float]] = {"single": {}, "pd": {}}
    try:  # one deployment at a time: an idle one beside it slowed the other in shared runs
        for name in ("single", "pd"):
            if name == "single":
                url = start_single(procs, serve_args, single_pin)
            else:
                url, _ = start_1p1d(procs, serve_args, setup, p_pin, d_pin)
            gen = torch.Generator().manual_seed(0)
            for prompt_len in lengths:
                seconds[name][prompt_len] = medians(url, prompt_len, repeats[prompt_len], gen)
            if name == "pd":
                print(f"    KV paths: {kv_paths(url)}", flush=True)
            procs.stop()
    finally:
        procs.stop()
    rows = []
    for prompt_len in lengths:
        single_s, pd_s = seconds["single"][prompt_len], seconds["pd"][prompt_len]
        row = TTFTRow(mode, prompt_len, single_s, pd_s, repeats[prompt_len])
        rows.append(row)
        print(
            f"    {prompt_len:5d} tokens   single {single_s * 1000:8.1f} ms   "
            f"1P1D {pd_s * 1000:8.1f} ms   overhead {100 * row.overhead:+6.1f} %   "
            f"(median of {row.repeats}, load {load_average()})",
            flush=True,
        )
    print(f"    logs: {log_dir}", flush=True)
    return rows


def print_verdict(rows: list[TTFTRow]) -> None:
    """The target's line: pinned 1P1D at 2k tokens within +10 % of one instance."""
    for row in rows:
        if row.mode == "pinned" and row.prompt_len == TARGET_TOKENS:
            met = "met" if row.overhead <= TARGET_OVERHEAD else "NOT met"
            print(
                f"target: pinned 1P1D at {TARGET_TOKENS} tokens <= +{TARGET_OVERHEAD:.0%} over "
                f"one instance: {100 * row.overhead:+.1f} % ({met})"
            )


def repeats_for(lengths: list[int], repeats: int | None, quick: bool) -> dict[int, int]:
    """Requests per length: fewer for long prompts unless ``--repeats`` says."""
    if repeats is not None:
        return dict.fromkeys(lengths, repeats)
    if quick:
        return dict.fromkeys(lengths, 3)
    return {n: 10 if n <= 4096 else 5 for n in lengths}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="256 and 2k tokens, 3 repeats")
    ap.add_argument("--tokens", default=None, help="prompt lengths, default 256,2048,8192")
    ap.add_argument("--repeats", type=int, default=None, help="requests per length and side")
    add_deployment_args(ap)
    args = ap.parse_args()
    default = "256,2048" if args.quick else "256,2048,8192"
    lengths = [int(t) for t in (args.tokens or default).split(",")]
    modes = parse_modes(ap, args.modes)
    setup = PDSetup(args.send_type, args.transport)
    print(f"machine: {machine_info()}")
    print(
        f"TTFT, small Llama (19M, fp32), distinct prompts, max_tokens=1; 1P1D {setup.send_type} "
        f"(same_host_transport: {setup.transport or 'default'}) via the proxy vs one instance"
    )
    with tempfile.TemporaryDirectory(prefix="pd_ttft_model_") as tmp:
        model = Path(tmp) / "model"
        build_small_llama(model)
        rows = []
        for mode in modes:
            rows += run_mode(
                model, mode, lengths, repeats_for(lengths, args.repeats, args.quick), setup
            )
    print_verdict(rows)


if __name__ == "__main__":
    main()
