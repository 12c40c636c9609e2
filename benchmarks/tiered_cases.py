"""The cases of ``tiered_cache.py`` beyond one replay per configuration: a restart between
the trace's halves, 32 requests loading one prefix from the host tier at once, and decode
steps while the tiers store in the background."""

from __future__ import annotations

import shutil
import statistics
import tempfile
from dataclasses import dataclass

from mooncake_trace import OracleCache, TraceRequest
from tiered_setup import Setup
from trace_replay import ReplayResult, StepTimer, greedy, replay, run_together, settle

from pagedkv.engine.request_input import RequestInput


@dataclass
class RestartResult:
    """The trace's second half after a restart, without tiers and with host + disk on the
    first half's directory; and returning conversations' TTFT alone, loaded from disk
    against recomputed."""

    cold: ReplayResult
    disk: ReplayResult
    returning_disk: list[float]
    returning_recompute: list[float]
    returning_hit_tokens: list[int]


def returning_requests(
    first: list[TraceRequest], second: list[TraceRequest], block_size: int, count: int
) -> list[TraceRequest]:
    """The ``count`` requests of the second half with the longest prefix in the first half:
    conversations returning after the restart with the most history."""
    oracle = OracleCache(block_size)
    for request in first:
        oracle.hit_tokens(request)
    usable = [(oracle.lookup(r), i) for i, r in enumerate(second)]
    best = sorted(usable, key=lambda hit_index: (-hit_index[0], hit_index[1]))[:count]
    return [second[i] for _, i in sorted(best, key=lambda hit_index: hit_index[1])]


def ttft_alone(engine, prompt: list[int], max_tokens: int = 1) -> tuple[float, int]:
    """One request on an otherwise idle engine with an empty pool: (TTFT, hit tokens)."""
    engine.reset_prefix_cache()
    (out,) = run_together(engine, [prompt], max_tokens)
    return out.metrics.time_to_first_token, out.num_cached_tokens


def run_restart(setup: Setup, returning: int) -> RestartResult:
    """First half with host (a third of the working set) + disk (all of it) tiers; the
    engine shut down; a new one on the same directory replays the second half. A copy of
    the directory, taken at the restart, serves the returning requests alone."""
    half = len(setup.requests) // 2
    first, second = setup.requests[:half], setup.requests[half:]
    with tempfile.TemporaryDirectory() as root:
        disk, snapshot = f"{root}/disk", f"{root}/snapshot"
        config = setup.tiers(setup.working_set // 3, disk, setup.working_set)
        setup.wait_for_quiet()
        engine = setup.engine(config)
        replay(engine, first, setup.tokens, setup.speedup)
        settle(engine)
        engine.shutdown()
        shutil.copytree(disk, snapshot)
        setup.wait_for_quiet()
        engine = setup.engine(config)
        disk_result = replay(engine, second, setup.tokens, setup.speedup)
        engine.shutdown()
        setup.wait_for_quiet()
        cold = setup.engine()
        cold_result = replay(cold, second, setup.tokens, setup.speedup)
        probes = returning_requests(first, second, setup.block_size, returning)
        loaded = setup.engine(setup.tiers(setup.working_set // 3, snapshot, setup.working_set))
        from_disk, recompute, hits = [], [], []
        for request in probes:  # loaded and recomputed in turn, meeting the same machine
            prompt = setup.tokens.prompt(request)
            ttft, hit = ttft_alone(loaded, prompt)
            from_disk.append(ttft)
            hits.append(hit)
            recompute.append(ttft_alone(cold, prompt)[0])
        loaded.shutdown()
        cold.shutdown()
    return RestartResult(cold_result, disk_result, from_disk, recompute, hits)


@dataclass
class ConcurrentResult:
    prefix_tokens: int
    alone: list[float]
    together_p99: list[float]
    #: The same together with the prefix in the pool: their compute alone, no load.
    pooled_p99: list[float]
    hit_tokens: list[int]


def _p99_ttft(engine, prompts: list[list[int]]) -> tuple[float, list[int]]:
    """Submit ``prompts`` at once: the p99 of their TTFTs, and their hit tokens."""
    outs = run_together(engine, prompts)
    ttfts = sorted(out.metrics.time_to_first_token for out in outs)
    p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
    return p99, [out.num_cached_tokens for out in outs]


def run_concurrent(setup: Setup, concurrency: int, prefix_tokens: int, repeats: int):
    """``concurrency`` requests sharing a ``prefix_tokens`` prefix that only the host tier
    holds (the pool emptied), submitted at once, against one such request alone; and as
    many again with the prefix in the pool (their compute, without a load)."""
    prefix_blocks = prefix_tokens // setup.block_size
    prefix = setup.random_prompt(prefix_blocks * setup.block_size, seed=0)
    pool = (concurrency + 2) * (prefix_blocks + 2)  # room even if no load is shared
    engine = setup.engine(setup.tiers(4 * prefix_blocks), pool_blocks=pool)
    run_together(engine, [prefix + setup.random_prompt(8, seed=1)])
    settle(engine)
    result = ConcurrentResult(prefix_tokens, [], [], [], [])
    for repeat in range(repeats):
        seed = 100 + repeat * (concurrency + 1)
        setup.wait_for_quiet()
        ttft, hit = ttft_alone(engine, prefix + setup.random_prompt(8, seed))
        result.alone.append(ttft)
        result.hit_tokens.append(hit)
        engine.reset_prefix_cache()
        prompts = [prefix + setup.random_prompt(8, seed + 1 + i) for i in range(concurrency)]
        p99, hits = _p99_ttft(engine, prompts)
        result.together_p99.append(p99)
        result.hit_tokens.extend(hits)
        prompts = [
            prefix + setup.random_prompt(8, 1_000_000 + seed + i) for i in range(concurrency)
        ]
        result.pooled_p99.append(_p99_ttft(engine, prompts)[0])
    engine.shutdown()
    return result


@dataclass
class DecodeResult:
    no_tiers: list[float]
    tiers: list[float]


def _decode_round(setup: Setup, engine, timer: StepTimer, seed: int, quick: bool) -> None:
    """16 (quick: 8) requests decoding; every 4th step a short request arrives and ends
    after its prefill, so its blocks are stored while the others decode."""
    long_count, long_tokens, short_count = (8, 32, 6) if quick else (16, 128, 24)
    for i in range(long_count):
        prompt = setup.random_prompt(512, seed * 1000 + i)
        engine.add_request(RequestInput(prompt, greedy(long_tokens)))
    steps, shorts = 0, 0
    while engine.has_unfinished_requests():
        if steps % 4 == 3 and shorts < short_count:
            prompt = setup.random_prompt(256, seed * 1000 + 500 + shorts)
            engine.add_request(RequestInput(prompt, greedy(1)))
            shorts += 1
        timer.step()
        steps += 1


def run_decode(setup: Setup, rounds: int, quick: bool) -> DecodeResult:
    """Pure decode step times without tiers and with host + disk tiers, the two engines
    taking turns (so both meet the same machine); fresh prompts each round."""
    long_count = 8 if quick else 16
    pool = long_count * (512 + 128) // setup.block_size + 8 * 512 // setup.block_size
    with tempfile.TemporaryDirectory() as disk:
        engines = {
            "no_tiers": setup.engine(pool_blocks=pool),
            "tiers": setup.engine(setup.tiers(4 * pool, disk, 8 * pool), pool_blocks=pool),
        }
        timers = {name: StepTimer(engine) for name, engine in engines.items()}
        for name, engine in engines.items():  # a warm-up round, not counted
            _decode_round(setup, engine, timers[name], seed=0, quick=quick)
            timers[name].decode_steps.clear()
        for round_ in range(1, rounds + 1):
            for name, engine in engines.items():
                _decode_round(setup, engine, timers[name], seed=round_, quick=quick)
        for engine in engines.values():
            engine.shutdown()
    return DecodeResult(timers["no_tiers"].decode_steps, timers["tiers"].decode_steps)


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3
