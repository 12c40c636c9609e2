#!/usr/bin/env python
"""The store connector against raw redis-py, and the TTFT a stored prefix saves, in one run.

1. put/get GB/s of realistic blocks: 32 layers x 8 KV heads x 128 head size x 16 tokens x fp16
   = 2 MiB per block value, batches of 16/32/64 blocks. Ours is the connector's whole path:
   put = ``BlockWriter.store`` (exists_many, paged-cache snapshot -> payload rows, header +
   xxh3-64, one pipelined put_many); get = ``BlockFetcher.load`` (pipelined get_many, verify,
   scatter into a paged cache). Raw is redis-py MSET / MGET of the same bytes, on the same
   server, with the same connection settings (pure-Python command packer when hiredis is
   installed, 1 MiB socket reads); redis-py with its defaults is printed too.
2. TTFT of an instance whose 4k-token prompt prefix another instance stored (loaded from the
   store, async and sync) against computing it (a small random Llama, fp32, CPU).

    python benchmarks/store_bench.py             # < 3 min; starts its own redis-server
    python benchmarks/store_bench.py --quick
    python benchmarks/store_bench.py --redis-url redis://10.0.0.5:6379/0
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv.kv_transfer.store.backends import create_backend  # noqa: E402
from pagedkv.kv_transfer.store.block_layout import GroupLayout  # noqa: E402
from pagedkv.kv_transfer.store.config import StoreConfig  # noqa: E402
from pagedkv.kv_transfer.store.loader import BlockFetcher  # noqa: E402
from pagedkv.kv_transfer.store.metadata import BlockRef  # noqa: E402
from pagedkv.kv_transfer.store.recent_keys import RecentKeys  # noqa: E402
from pagedkv.kv_transfer.store.stats import StoreStats  # noqa: E402
from pagedkv.kv_transfer.store.writer import BlockWriter, PutJob  # noqa: E402

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16


def start_redis() -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server not found: install it or pass --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port, socket_timeout=1).ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.exceptions.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                sys.exit("redis-server did not start")
            time.sleep(0.05)


def median_times(
    fns: dict[str, Callable[[], object]], repeats: int, setup: Callable[[], object]
) -> dict[str, float]:
    """Median seconds of each function; every repeat runs all of them in turn, so that load
    from other processes on a shared machine spreads evenly over the variants."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            setup()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def raw_client(url: str, tuned: bool) -> redis.Redis:
    if not tuned:
        return redis.Redis.from_url(url)
    options: dict = {"socket_read_size": 1 << 20}
    if redis.connection.HIREDIS_AVAILABLE:
        encoder = redis.connection.Encoder("utf-8", "strict", False)
        options["command_packer"] = redis.connection.PythonRespSerializer(6000, encoder.encode)
    return redis.Redis(connection_pool=redis.ConnectionPool.from_url(url, **options))


def measure_batch(
    n: int,
    caches,
    layout: GroupLayout,
    writer: BlockWriter,
    fetcher: BlockFetcher,
    clients,
    repeats,
) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds to put and to get ``n`` blocks: ours, raw (tuned) and raw (default)."""
    tuned, default = clients
    keys = [f"bench:ours:{i}" for i in range(n)]
    raw_keys = [f"bench:raw:{i}" for i in range(n)]
    job = PutJob(layout, keys, set(), layout.snapshot(caches, torch.arange(1, n + 1)))
    writer.store(job)  # also gives the raw path the very same bytes
    mapping = dict(zip(raw_keys, [bytes(v) for v in fetcher.backend.get_many(keys)]))
    refs = [BlockRef(0, n + 1 + i, key) for i, key in enumerate(keys)]

    def forget() -> None:
        tuned.delete(*keys, *raw_keys)

    put = median_times(
        {
            "ours": lambda: writer.store(job),
            "raw": lambda: tuned.mset(mapping),
            "default": lambda: default.mset(mapping),
        },
        repeats,
        forget,
    )
    writer.store(job)
    tuned.mset(mapping)
    get = median_times(
        {
            "ours": lambda: fetcher.load(refs),
            "raw": lambda: tuned.mget(raw_keys),
            "default": lambda: default.mget(raw_keys),
        },
        repeats,
        lambda: None,
    )
    loaded = torch.stack([c[:, n + 1 : 2 * n + 1] for c in caches])
    assert torch.equal(loaded, torch.stack([c[:, 1 : n + 1] for c in caches]))
    forget()
    return put, get


def bench_put_get(url: str, batch_sizes: list[int], repeats: int) -> None:
    num_blocks = 2 * max(batch_sizes) + 1
    caches = [
        torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, dtype=torch.float16)
        for _ in range(LAYERS)
    ]
    layout = GroupLayout(0, tuple(range(LAYERS)), (2, BLOCK_SIZE, KV_HEADS, HEAD_SIZE * 2))
    size = layout.payload_size
    backend = create_backend(StoreConfig(store_url=url))
    stats, recent = StoreStats(), RecentKeys()
    writer = BlockWriter(backend, stats, recent, max_queued_bytes=1 << 40)
    fetcher = BlockFetcher(backend, [layout], caches, stats, recent)
    clients = raw_client(url, tuned=True), raw_client(url, tuned=False)
    print(f"hiredis installed: {redis.connection.HIREDIS_AVAILABLE}; block value {size >> 20} MiB")
    print(
        f"{'blocks':>6} {'MiB':>5} | {'put GB/s ours':>13} {'raw':>6} {'ratio':>5} "
        f"{'default':>7} | {'get GB/s ours':>13} {'raw':>6} {'ratio':>5} {'default':>7}"
    )
    for n in batch_sizes:
        put, get = measure_batch(n, caches, layout, writer, fetcher, clients, repeats)
        gb = n * size / 1e9
        print(
            f"{n:>6} {n * size >> 20:>5} | {gb / put['ours']:>13.2f} {gb / put['raw']:>6.2f} "
            f"{put['raw'] / put['ours']:>5.2f} {gb / put['default']:>7.2f} | "
            f"{gb / get['ours']:>13.2f} {gb / get['raw']:>6.2f} "
            f"{get['raw'] / get['ours']:>5.2f} {gb / get['default']:>7.2f}",
            flush=True,
        )
    assert stats.num_load_invalid == 0 and stats.num_put_failures == 0
    writer.close()
    backend.close()
    for client in clients:
        client.close()


def build_model(directory: Path, max_len: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=max_len,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def time_to_first_token(llm, prompt: list[int], params) -> tuple[float, int]:
    engine = llm.llm_engine
    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    engine.add_request(None, prompt, params)
    token = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if token is None and out.outputs[0].token_ids:
                token = out.outputs[0].token_ids[0]
                ttft = time.perf_counter() - t0
    return ttft, token


def bench_ttft(url: str, prefix_tokens: int, repeats: int) -> None:
    from pagedkv import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 1024, (prefix_tokens,), generator=gen).tolist()
    stored_prompt = prefix + torch.randint(3, 1024, (40,), generator=gen).tolist()
    prompt = prefix + torch.randint(3, 1024, (40,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), prefix_tokens + 256)

        def store_llm(role: str, load_mode: str = "async"):
            extra = {"store_url": url, "load_mode": load_mode}
            kv = {
                "kv_connector": "StoreConnector",
                "kv_role": role,
                "kv_connector_extra_config": extra,
            }
            return LLM(tmp, kv_transfer_config=kv)

        writer = store_llm("kv_producer")
        writer.generate([stored_prompt], params, use_tqdm=False)  # returns once stored
        writer.llm_engine.shutdown()
        runs = {"recompute": LLM(tmp)}
        for mode in ("async", "sync"):
            runs[f"store ({mode} load)"] = store_llm("kv_consumer", mode)
        ttfts: dict[str, list[float]] = {name: [] for name in runs}
        computed = {}
        tokens = set()
        for name, llm in runs.items():  # warm-up, then every run measures each mode in turn
            tokens.add(time_to_first_token(llm, prompt, params)[1])
            computed[name] = llm.llm_engine.get_stats().num_prompt_tokens
        for _ in range(repeats):
            for name, llm in runs.items():
                ttft, token = time_to_first_token(llm, prompt, params)
                ttfts[name].append(ttft)
                tokens.add(token)
        results = {name: statistics.median(times) for name, times in ttfts.items()}
        for name, llm in runs.items():
            per_run = (llm.llm_engine.get_stats().num_prompt_tokens - computed[name]) // repeats
            print(
                f"  {name:<20} TTFT median {results[name] * 1e3:8.1f} ms over {repeats} runs "
                f"(prompt tokens computed per run: {per_run})",
                flush=True,
            )
            llm.llm_engine.shutdown()
        assert len(tokens) == 1, "the first token differs between runs"
        for name in list(runs)[1:]:
            print(f"  {name}: {results['recompute'] / results[name]:.1f}x faster than recompute")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--redis-url", default=None, help="use this server (default: start one)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller batches")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("pagedkv.engine.llm_engine").setLevel(logging.ERROR)  # no tokenizer: fine
    proc, url = (None, args.redis_url) if args.redis_url else start_redis()
    try:
        print(
            f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; store {url}"
        )
        print("== put/get of 2 MiB blocks (medians) ==")
        bench_put_get(url, [16] if args.quick else [16, 32, 64], 3 if args.quick else 7)
        prefix = 2048 if args.quick else 4096
        print(f"== TTFT with a {prefix}-token prefix in the store vs recomputing it ==")
        bench_ttft(url, prefix, 3 if args.quick else 5)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
