"""Tensor parallelism on the HF-peer workload (``throughput.py --tensor-parallel-size N``):
one engine at TP 1 (torch's threads over the whole machine) against one at TP N (one rank per
core run, ``--cpu-cores``' default split), side by side in one process run.

For each: the workload's wall time and output tokens/s (medians of ``--runs``, each after a
quiet machine, cold prefix cache), one request's TTFT and inter-token time, and for TP N the
share of rank 0's time spent in its collectives (all-reduces, and the logits' gather), waits for
the other ranks included. TP N's outputs are compared token for token with TP 1's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


class CollectiveClock:
    """Seconds rank 0 spends in ``TPGroup.all_reduce`` and ``gather`` while installed."""

    def __init__(self, tp) -> None:
        self.tp = tp
        self.seconds = 0.0
        self.calls = 0
        self._originals = {name: getattr(tp, name) for name in ("all_reduce", "gather")}

    def _timed(self, original: Callable) -> Callable:
        def call(x):
            start = time.perf_counter()
            try:
                return original(x)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return call

    def __enter__(self) -> CollectiveClock:
        for name, original in self._originals.items():
            setattr(self.tp, name, self._timed(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self._originals:
            delattr(self.tp, name)  # the class's methods again


def measure_engine(llm, prompts, greedy, args, wait_for_quiet, run_single, single_prompt) -> dict:
    """One engine's figures (module docstring)."""
    engine = llm.llm_engine
    llm.generate(prompts, type(greedy)(max_tokens=4, ignore_eos=True), use_tqdm=False)
    times = []
    outputs = None
    for _ in range(args.runs):
        engine.reset_prefix_cache()
        wait_for_quiet(args.quiet_threshold, args.max_wait)
        start = time.perf_counter()
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        times.append(time.perf_counter() - start)
    run_single(llm, single_prompt, 8)
    singles = [run_single(llm, single_prompt, greedy.max_tokens) for _ in range(args.runs)]
    figures = dict(
        times_s=times,
        median_s=statistics.median(times),
        ttft_ms=1e3 * statistics.median(s["ttft"] for s in singles),
        itl_ms=1e3 * statistics.median(s["itl_median"] for s in singles),
        tokens=[o.outputs[0].token_ids for o in outputs],
    )
    tp = getattr(engine.executor, "tp", None)
    if tp is not None:  # one more run, with rank 0's collectives timed
        engine.reset_prefix_cache()
        with CollectiveClock(tp) as clock:
            start = time.perf_counter()
            llm.generate(prompts, greedy, use_tqdm=False)
            wall = time.perf_counter() - start
        figures["collective_share"] = clock.seconds / wall
        figures["collective_calls"] = clock.calls
        figures["collective_us_per_call"] = 1e6 * clock.seconds / max(clock.calls, 1)
    return figures


def compare_tp(model_dir, prompts, greedy, args, total_out, bench_hf, run_single, wl) -> dict:
    """TP 1 against TP ``args.tensor_parallel_size``, one engine at a time; prints the table."""
    from pagedkv import LLM

    results = {}
    for tp in (1, args.tensor_parallel_size):
        llm = LLM(model_dir, dtype=args.dtype, device="cpu", tensor_parallel_size=tp)
        results[tp] = measure_engine(
            llm, prompts, greedy, args, bench_hf.wait_for_quiet, run_single, wl.single_request()
        )
        llm.llm_engine.shutdown()
        del llm
    one, many = results[1], results[args.tensor_parallel_size]
    mismatches = sum(a != b for a, b in zip(one.pop("tokens"), many.pop("tokens")))
    n = args.tensor_parallel_size
    for tp, row in results.items():
        print(
            f"TP {tp}: median {row['median_s']:.2f} s ({total_out / row['median_s']:.0f} output "
            f"tok/s), runs {[round(t, 2) for t in row['times_s']]}; single request TTFT "
            f"{row['ttft_ms']:.1f} ms, inter-token {row['itl_ms']:.2f} ms",
            flush=True,
        )
    print(
        f"TP {n} / TP 1 throughput: {one['median_s'] / many['median_s']:.2f}x; rank 0 in "
        f"collectives {100 * many['collective_share']:.1f} % of the run "
        f"({many['collective_calls']} calls, {many['collective_us_per_call']:.1f} us each); "
        f"single-request inter-token {many['itl_ms']:.2f} vs {one['itl_ms']:.2f} ms; "
        f"{mismatches} of {len(prompts)} outputs differ from TP 1's",
        flush=True,
    )
    return dict(
        tp1=one,
        tpn=many,
        tensor_parallel_size=n,
        throughput_ratio=one["median_s"] / many["median_s"],
        outputs_differing=mismatches,
    )
