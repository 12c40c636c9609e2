#!/usr/bin/env python
"""Tiered KV cache (the OffloadingConnector: host memory, local disk) against the pool alone,
on a multi-turn trace in the Mooncake traces' format, in one run.

The trace (``--trace FILE``, any file of that format; by default one generated here:
conversations whose turns resend the growing history after a shared system prompt) is
replayed in this process through ``LLMEngine``: each hash id becomes one pagedkv block of
``--block-size`` deterministic token ids instead of 512 tokens (``mooncake_trace.py``), so
prefix reuse is exactly the trace's; arrival times are the trace's divided by ``--speedup``.
The model is a random Llama (256 hidden, 4 layers, fp32) with a context just long enough for
the trace's longest request; the pool holds a third of the trace's working set (its distinct
full blocks) or, when one request needs more, that request.

Configurations: device-only (the pool alone); + host (a host tier sized to the working set);
+ host + disk (host a third of the working set, disk all of it). Each: prefix hit rate in
tokens (pool and tier hits, ``num_cached_tokens``) against the infinite-cache oracle, TTFT
p50 / p99, throughput (prompt and output tokens per second, first arrival to last token).
Then: the restart case (the first half of the trace with host + disk, a new engine on the
same directory for the second half; against a restart without tiers), with returning
conversations' TTFT alone, loaded from disk, against recomputing them; 32 requests loading
one prefix from the host tier at once, against one alone; pure decode step time with the
tiers storing in the background, against no tiers.

    python benchmarks/tiered_cache.py                 # a few minutes on 2 cores
    python benchmarks/tiered_cache.py --quick         # CI-sized
    python benchmarks/tiered_cache.py --make-trace conv.jsonl
    python benchmarks/tiered_cache.py --trace conv.jsonl --speedup 4
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from dataclasses import asdict, fields
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))
from mooncake_trace import TraceShape, make_trace, read_trace, write_trace  # noqa: E402
from tiered_cases import median_ms, run_concurrent, run_decode, run_restart  # noqa: E402
from tiered_setup import ModelShape, Setup, build_model  # noqa: E402
from trace_replay import ReplayResult, Summary, replay  # noqa: E402

CASES = ("trace", "restart", "concurrent", "decode")
QUICK_SHAPE = TraceShape(
    conversations=8, turns=4, system_blocks=4, user_tokens=3072, output_tokens=512,
    start_gap_ms=500, think_ms=6000,
)  # fmt: skip


def run_configs(setup: Setup, repeats: int) -> dict[str, Summary]:
    """The whole trace once per configuration and repeat, each on a fresh engine, the
    configurations taking turns (so that each meets the same machine)."""
    results: dict[str, list[ReplayResult]] = {}
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(repeats):
            disk = f"{root}/disk{repeat}"
            configs = {
                "device-only": None,
                "+ host": setup.tiers(setup.working_set),
                "+ host + disk": setup.tiers(setup.working_set // 3, disk, setup.working_set),
            }
            for name, config in configs.items():
                results.setdefault(name, []).append(replay_quietly(setup, name, config))
    return {name: Summary.of(runs) for name, runs in results.items()}


def replay_quietly(setup: Setup, name: str, config: dict | None) -> ReplayResult:
    """One replay on a fresh engine after waiting for a quiet machine; rerun once when other
    processes took more than the threshold of it meanwhile."""
    for _ in range(2):
        setup.wait_for_quiet()
        engine = setup.engine(config)
        result = replay(engine, setup.requests, setup.tokens, setup.speedup)
        stats = engine.get_kv_connector_stats()
        engine.shutdown()
        tiers = {k: v for k, v in stats.items() if "hit_tokens" in k and v}
        print(
            f"  {name}: done in {result.wall_s:.1f} s, others used "
            f"{result.others_share:.0%} of the machine {tiers or ''}",
            flush=True,
        )
        if result.others_share <= setup.quiet_threshold:
            break
    return result


def row(name: str, summary: Summary, oracle_rate: float) -> str:
    return (
        f"  {name:<28} {summary.hit_rate:>8.3f} {summary.hit_rate / oracle_rate:>7.2f} "
        f"{summary.ttft_p50 * 1e3:>9.1f} {summary.ttft_p99 * 1e3:>9.1f} "
        f"{summary.throughput:>9.0f} {summary.cpu_s:>7.1f} {summary.others_share:>7.0%}"
    )


def print_table(setup: Setup, results: dict[str, Summary], restart) -> None:
    total = sum(len(setup.tokens.prompt(r)) for r in setup.requests)
    oracle_rate = sum(setup.oracle) / total
    print(
        f"\n  {'':<28} {'hit rate':>8} {'/oracle':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'tok/s':>9} {'CPU s':>7} {'others':>7}"
    )
    print(f"  {'oracle (infinite cache)':<28} {oracle_rate:>8.3f} {1:>7.2f}")
    for name, summary in results.items():
        print(row(name, summary, oracle_rate))
    if restart is not None:
        half = len(setup.requests) // 2
        second = setup.requests[half:]
        second_rate = sum(setup.oracle[half:]) / sum(len(setup.tokens.prompt(r)) for r in second)
        print(f"  second half after a restart: oracle hit rate {second_rate:.3f}")
        print(row("restart, no tiers", Summary.of([restart.cold]), second_rate))
        print(row("restart, host + disk", Summary.of([restart.disk]), second_rate))
    runs = max((s.runs for s in results.values()), default=1)
    print(
        f"  (TTFT in ms; /oracle: the hit rate over the oracle's on the same requests; "
        f"others: the share of the machine other processes used; medians of {runs} replays)"
    )


def verdict(name: str, value: float, target: float, at_most: bool, unit: str = "x") -> dict:
    met = value <= target if at_most else value >= target
    sign, word = ("<=" if at_most else ">="), ("met" if met else "NOT met")
    print(f"  {name:<58} {value:>6.2f}{unit}  (target {sign} {target}{unit})  {word}")
    return dict(name=name, value=value, target=target, met=met)


def print_targets(setup: Setup, results: dict, restart, concurrent, decode) -> list[dict]:
    print("\nTargets")
    out = []
    if results:
        total = sum(len(setup.tokens.prompt(r)) for r in setup.requests)
        oracle_rate = sum(setup.oracle) / total
        host, device = results["+ host"], results["device-only"]
        out.append(
            verdict("hit rate, + host / oracle", host.hit_rate / oracle_rate, 0.9, False, "")
        )
        out.append(
            verdict("hit rate, + host / device-only", host.hit_rate / device.hit_rate, 2, False)
        )
        ttft = host.ttft_p50 / device.ttft_p50
        out.append(verdict("TTFT p50, + host / device-only", ttft, 0.6, True))
    if restart is not None:
        ratio = median_ms(restart.returning_disk) / median_ms(restart.returning_recompute)
        out.append(
            verdict("returning conversation after a restart, disk / recompute", ratio, 0.2, True)
        )
    if concurrent is not None:
        ratio = median_ms(concurrent.together_p99) / median_ms(concurrent.alone)
        out.append(
            verdict("same prefix from host, p99 of concurrent / one alone", ratio, 1.5, True)
        )
    if decode is not None:
        ratio = median_ms(decode.tiers) / median_ms(decode.no_tiers)
        out.append(verdict("decode step, tiers storing / no tiers", ratio, 1.05, True))
    return out


def print_details(restart, concurrent, decode) -> None:
    if restart is not None:
        print(
            f"\nReturning conversations after a restart ({len(restart.returning_disk)} requests, "
            f"each alone): TTFT median {median_ms(restart.returning_disk):.1f} ms loaded "
            f"(hit tokens {restart.returning_hit_tokens}) vs "
            f"{median_ms(restart.returning_recompute):.1f} ms recomputed"
        )
    if concurrent is not None:
        together = len(concurrent.hit_tokens) // len(concurrent.alone) - 1
        pooled = median_ms(concurrent.together_p99) / median_ms(concurrent.pooled_p99)
        print(
            f"Same {concurrent.prefix_tokens}-token prefix from the host tier: one alone "
            f"{median_ms(concurrent.alone):.1f} ms, p99 of {together} "
            f"together {median_ms(concurrent.together_p99):.1f} ms (medians of "
            f"{len(concurrent.alone)}); hit tokens {sorted(set(concurrent.hit_tokens))}; p99 "
            f"with the prefix in the pool {median_ms(concurrent.pooled_p99):.1f} ms (their "
            f"compute alone; from the host tier {pooled:.2f}x that)"
        )
    if decode is not None:
        print(
            f"Pure decode steps: {median_ms(decode.no_tiers):.2f} ms without tiers "
            f"({len(decode.no_tiers)} steps), {median_ms(decode.tiers):.2f} ms with host + disk "
            f"storing ({len(decode.tiers)} steps)"
        )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", default=None, help="a Mooncake-format trace (default: generate)")
    ap.add_argument("--make-trace", default=None, metavar="PATH", help="write the trace; exit")
    for f in fields(TraceShape):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per hash id")
    ap.add_argument("--speedup", type=float, default=8.0, help="trace time / replay time")
    ap.add_argument("--repeats", type=int, default=2, help="replays per configuration")
    ap.add_argument("--cases", default=",".join(CASES), help=f"some of {','.join(CASES)}")
    ap.add_argument("--quick", action="store_true", help="a small trace, fewer repeats")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--hidden-size", type=int, default=ModelShape.hidden_size)
    ap.add_argument("--num-layers", type=int, default=ModelShape.num_layers)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.25,
        help="wait before each timed run until other processes use less than this share of "
        "the machine, and rerun a replay once when they used more (1.0 disables)",
    )
    ap.add_argument("--max-wait", type=float, default=20, help="seconds, per wait")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    args.vocab_size = ModelShape.vocab_size
    base = QUICK_SHAPE if args.quick else TraceShape()
    given = {f.name: getattr(args, f.name) for f in fields(TraceShape)}
    args.shape = TraceShape(**{**asdict(base), **{k: v for k, v in given.items() if v is not None}})
    return args


def main() -> None:
    args = parse_args()
    requests = read_trace(args.trace) if args.trace else make_trace(args.shape)
    if args.make_trace:
        write_trace(args.make_trace, requests)
        print(f"{len(requests)} requests written to {args.make_trace}")
        return
    torch.set_num_threads(args.threads)
    logging.getLogger("pagedkv.engine.llm_engine").setLevel(logging.ERROR)  # no tokenizer: fine
    cases = set(args.cases.split(","))
    with tempfile.TemporaryDirectory() as model_dir:
        setup = Setup.plan(requests, model_dir, args)
        build_model(
            Path(model_dir), ModelShape(args.hidden_size, args.num_layers), setup.max_model_len
        )
        setup.measure_block_bytes()
        print(
            f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads\n"
            f"trace: {args.trace or args.shape}\n  {len(requests)} requests, working set "
            f"{setup.working_set} blocks of {setup.block_size} tokens ({setup.block_bytes} bytes "
            f"each), pool {setup.pool_blocks} blocks, max_model_len {setup.max_model_len}, "
            f"speedup {setup.speedup}",
            flush=True,
        )
        results = run_configs(setup, 1 if args.quick else args.repeats) if "trace" in cases else {}
        restart = run_restart(setup, 3 if args.quick else 8) if "restart" in cases else None
        concurrent = None
        if "concurrent" in cases:
            concurrent = run_concurrent(
                setup, 32, 512 if args.quick else 1024, 1 if args.quick else 3
            )
        decode = (
            run_decode(setup, 1 if args.quick else 3, args.quick) if "decode" in cases else None
        )
    print_table(setup, results, restart)
    print_details(restart, concurrent, decode)
    verdicts = print_targets(setup, results, restart, concurrent, decode)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        figures = {name: asdict(s) for name, s in results.items()}
        Path(args.json).write_text(json.dumps(dict(configs=figures, targets=verdicts), indent=1))


if __name__ == "__main__":
    main()
