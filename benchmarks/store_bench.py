#!/usr/bin/env python
"""The store connector against the raw store clients, and the TTFT a stored prefix saves, in
one run.

1. put/get GB/s of realistic blocks: 32 layers x 8 KV heads x 128 head size x 16 tokens x fp16
   = 2 MiB per block, stored as 8 values of 256 KiB (one per KV head), batches of 16/32/64
   blocks. Ours is the connector's whole path:
   put = ``BlockWriter.store`` (exists_many, paged-cache snapshot -> payload rows, header +
   xxh3-64, one put_from); get = ``BlockFetcher.load`` (one get_into, verify, scatter into a
   paged cache). The peer moves the same bytes with the raw client, in the same run:
   - Redis: redis-py MSET / MGET on the same server with the same connection settings
     (pure-Python command packer when hiredis is installed, 1 MiB socket reads); redis-py with
     its defaults is printed too;
   - Mooncake: ``batch_put_from`` / ``batch_get_into`` on a registered buffer, through a client
     of its own. Neither client lends memory: the values live in a ``mooncake_client`` process
     (as in a deployment, where most values are in another instance's segment).
2. TTFT of an instance whose 4k-token prompt prefix another instance stored (loaded from the
   store, async and sync) against computing it (a small random Llama, fp32, CPU), for Redis,
   a directory and Mooncake in one table.

    python benchmarks/store_bench.py             # < 5 min; starts redis-server and Mooncake
    python benchmarks/store_bench.py --quick
    python benchmarks/store_bench.py --redis-url redis://10.0.0.5:6379/0 \\
        --mooncake-url mooncake://10.0.0.5:50051
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
from urllib.parse import urlsplit

import numpy as np
import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv.distributed.shard import SINGLE_LAYOUT  # noqa: E402
from pagedkv.engine.request_input import RequestInput  # noqa: E402
from pagedkv.kv_transfer.store.backends import create_backend  # noqa: E402
from pagedkv.kv_transfer.store.block_codec import HEADER_SIZE  # noqa: E402
from pagedkv.kv_transfer.store.block_layout import GroupLayout  # noqa: E402
from pagedkv.kv_transfer.store.config import StoreConfig  # noqa: E402
from pagedkv.kv_transfer.store.head_layout import HeadLayout  # noqa: E402
from pagedkv.kv_transfer.store.loader import BlockFetcher  # noqa: E402
from pagedkv.kv_transfer.store.metadata import BlockRef  # noqa: E402
from pagedkv.kv_transfer.store.rank_heads import RankHeads  # noqa: E402
from pagedkv.kv_transfer.store.recent_keys import RecentKeys  # noqa: E402
from pagedkv.kv_transfer.store.stats import StoreStats  # noqa: E402
from pagedkv.kv_transfer.store.writer import BlockWriter, PutJob  # noqa: E402

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
#: The bench's Mooncake clients lend no memory: the values go to the segment host.
MOONCAKE_CLIENT = {"global_segment_size": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                sys.exit(f"{what} did not start")
            time.sleep(0.05)


def start_redis() -> tuple[list[subprocess.Popen], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server not found: install it or pass --redis-url")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    wait_for_port(port, proc, "redis-server")
    return [proc], f"redis://127.0.0.1:{port}/0"


def start_mooncake(segment_bytes: int) -> tuple[list[subprocess.Popen], str]:
    """``mooncake_master`` on loopback, and a ``mooncake_client`` lending ``segment_bytes``."""
    try:
        import mooncake.store
    except ImportError as e:
        sys.exit(f"Mooncake is not installed ({e}): pip install -e '.[mooncake]'")
    bin_dir = Path(mooncake.store.__file__).parent
    port, metrics_port, host_port = free_port(), free_port(), free_port()
    master = subprocess.Popen(
        [
            str(bin_dir / "mooncake_master"),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={metrics_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(port, master, "mooncake_master")
    host = subprocess.Popen(
        [
            str(bin_dir / "mooncake_client"),
            f"--master_server_address=127.0.0.1:{port}",
            "--metadata_server=P2PHANDSHAKE",
            "--host=127.0.0.1",
            f"--port={host_port}",
            f"--global_segment_size={segment_bytes}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(host_port, host, "mooncake_client")
    return [master, host], f"mooncake://127.0.0.1:{port}"


def extra_config(url: str) -> dict:
    if url.startswith("mooncake://"):
        return {"store_url": url, "mooncake": MOONCAKE_CLIENT}
    return {"store_url": url}


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


class ConnectorPath:
    """The connector's writer and fetcher over one store, with a paged cache of realistic
    blocks: blocks ``1..n`` are stored, and loaded into blocks ``n+1..2n``."""

    def __init__(self, url: str, max_blocks: int) -> None:
        num_blocks = 2 * max_blocks + 1
        self.caches = [
            torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, dtype=torch.float16)
            for _ in range(LAYERS)
        ]
        group = GroupLayout(0, tuple(range(LAYERS)), (2, BLOCK_SIZE, KV_HEADS, HEAD_SIZE * 2))
        self.layout = HeadLayout(group, RankHeads.of(SINGLE_LAYOUT, KV_HEADS))
        self.backend = create_backend(StoreConfig.from_extra_config(extra_config(url)))
        self.stats, recent = StoreStats(), RecentKeys()
        self.writer = BlockWriter(self.backend, self.stats, recent, max_queued_bytes=1 << 40)
        self.fetcher = BlockFetcher(self.backend, [self.layout], self.caches, self.stats, recent)

    @property
    def value_size(self) -> int:
        """One value: a header and one KV head's payload."""
        return HEADER_SIZE + self.layout.payload_size

    @property
    def block_bytes(self) -> int:
        """A block's bytes in the store: a value per KV head."""
        return KV_HEADS * self.value_size

    def value_keys(self, job: PutJob) -> list[str]:
        return self.layout.write_keys(job.keys)

    def job(self, n: int) -> tuple[PutJob, list[BlockRef]]:
        keys = [f"bench:ours:{i}" for i in range(n)]
        snapshot = self.layout.group.snapshot(self.caches, torch.arange(1, n + 1))
        refs = [BlockRef(0, n + 1 + i, key) for i, key in enumerate(keys)]
        return PutJob(self.layout, keys, set(), snapshot), refs

    def check_loaded(self, n: int) -> None:
        loaded = torch.stack([c[:, n + 1 : 2 * n + 1] for c in self.caches])
        assert torch.equal(loaded, torch.stack([c[:, 1 : n + 1] for c in self.caches]))
        assert self.stats.num_load_invalid == 0 and self.stats.num_put_failures == 0

    def close(self) -> None:
        self.writer.close()
        self.backend.close()


def print_header(peer: str) -> None:
    print(
        f"{'blocks':>6} {'MiB':>5} | {'put GB/s ours':>13} {peer:>6} {'ratio':>5} | "
        f"{'get GB/s ours':>13} {peer:>6} {'ratio':>5}",
        flush=True,
    )


def print_row(n: int, size: int, put: dict[str, float], get: dict[str, float], extra="") -> None:
    gb = n * size / 1e9
    print(
        f"{n:>6} {n * size >> 20:>5} | {gb / put['ours']:>13.2f} {gb / put['raw']:>6.2f} "
        f"{put['raw'] / put['ours']:>5.2f} | {gb / get['ours']:>13.2f} "
        f"{gb / get['raw']:>6.2f} {get['raw'] / get['ours']:>5.2f}{extra}",
        flush=True,
    )


def redis_client(url: str, tuned: bool) -> redis.Redis:
    if not tuned:
        return redis.Redis.from_url(url)
    options: dict = {"socket_read_size": 1 << 20}
    if redis.connection.HIREDIS_AVAILABLE:
        encoder = redis.connection.Encoder("utf-8", "strict", False)
        options["command_packer"] = redis.connection.PythonRespSerializer(6000, encoder.encode)
    return redis.Redis(connection_pool=redis.ConnectionPool.from_url(url, **options))


def measure_redis(path: ConnectorPath, n: int, tuned, default, repeats: int) -> tuple:
    """Median seconds to put and to get ``n`` blocks: ours, raw (tuned) and raw (default)."""
    job, refs = path.job(n)
    value_keys = path.value_keys(job)
    raw_keys = [f"bench:raw:{i}" for i in range(len(value_keys))]
    path.writer.store(job)  # also gives the raw path the very same bytes
    mapping = dict(zip(raw_keys, [bytes(v) for v in path.backend.get_many(value_keys)]))

    def forget() -> None:
        tuned.delete(*value_keys, *raw_keys)

    put = median_times(
        {
            "ours": lambda: path.writer.store(job),
            "raw": lambda: tuned.mset(mapping),
            "default": lambda: default.mset(mapping),
        },
        repeats,
        forget,
    )
    path.writer.store(job)
    tuned.mset(mapping)
    get = median_times(
        {
            "ours": lambda: path.fetcher.load(refs),
            "raw": lambda: tuned.mget(raw_keys),
            "default": lambda: default.mget(raw_keys),
        },
        repeats,
        lambda: None,
    )
    path.check_loaded(n)
    forget()
    return put, get


def bench_redis_put_get(url: str, batch_sizes: list[int], repeats: int) -> None:
    """Ours against tuned redis-py MSET / MGET (redis-py with its defaults: last column)."""
    path = ConnectorPath(url, max(batch_sizes))
    tuned, default = redis_client(url, tuned=True), redis_client(url, tuned=False)
    print(f"hiredis installed: {redis.connection.HIREDIS_AVAILABLE}; peer: tuned redis-py")
    print_header("raw")
    for n in batch_sizes:
        put, get = measure_redis(path, n, tuned, default, repeats)
        gb = n * path.block_bytes / 1e9
        defaults = f" | defaults: put {gb / put['default']:.2f}, get {gb / get['default']:.2f}"
        print_row(n, path.block_bytes, put, get, defaults)
    path.close()
    for client in (tuned, default):
        client.close()


def measure_mooncake(path: ConnectorPath, n: int, raw, values: np.ndarray, repeats: int) -> tuple:
    """Median seconds to put and to get ``n`` blocks: ours, and the raw client's zero-copy
    calls on the same bytes (``values``: a buffer registered with ``raw``)."""
    job, refs = path.job(n)
    value_keys = path.value_keys(job)
    num_values, size = len(value_keys), path.value_size
    raw_keys = [f"bench:raw:{i}" for i in range(num_values)]
    ptrs, sizes = [values.ctypes.data + i * size for i in range(num_values)], [size] * num_values
    path.writer.store(job)  # the raw path moves the very same bytes
    assert raw.batch_get_into(value_keys, ptrs, sizes) == sizes

    def forget() -> None:
        raw.batch_remove(value_keys + raw_keys, force=True)

    def raw_put() -> None:
        assert raw.batch_put_from(raw_keys, ptrs, sizes) == [0] * num_values

    def raw_get() -> None:
        assert raw.batch_get_into(raw_keys, ptrs, sizes) == sizes

    put = median_times({"ours": lambda: path.writer.store(job), "raw": raw_put}, repeats, forget)
    path.writer.store(job)
    raw_put()
    get = median_times(
        {"ours": lambda: path.fetcher.load(refs), "raw": raw_get}, repeats, lambda: None
    )
    path.check_loaded(n)
    forget()
    return put, get


def bench_mooncake_put_get(url: str, batch_sizes: list[int], repeats: int) -> None:
    """Ours against the raw client's batch_put_from / batch_get_into of the same bytes."""
    from mooncake.store import MooncakeDistributedStore

    from pagedkv.kv_transfer.store.backends.mooncake_backend import DEFAULT_PORT

    path = ConnectorPath(url, max(batch_sizes))
    master = urlsplit(url)
    raw = MooncakeDistributedStore()
    rc = raw.setup(
        "127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "",
        f"{master.hostname}:{master.port or DEFAULT_PORT}",
    )  # fmt: skip
    assert rc == 0, f"raw client setup -> {rc}"
    values = np.empty((max(batch_sizes) * KV_HEADS, path.value_size), dtype=np.uint8)
    assert raw.register_buffer(values.ctypes.data, values.nbytes) == 0
    print("peer: the raw client's batch_put_from / batch_get_into (registered buffer)")
    print_header("raw")
    for n in batch_sizes:
        put, get = measure_mooncake(path, n, raw, values, repeats)
        print_row(n, path.block_bytes, put, get)
    path.close()
    raw.close()


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
    engine.add_request(RequestInput(prompt, params))
    token = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if token is None and out.outputs[0].token_ids:
                token = out.outputs[0].token_ids[0]
                ttft = time.perf_counter() - t0
    return ttft, token


def bench_ttft(urls: dict[str, str], prefix_tokens: int, repeats: int) -> None:
    """One table: TTFT of a prompt whose prefix another instance stored, per store and load
    mode, against recomputing it; every repeat measures each row in turn."""
    from pagedkv import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 1024, (prefix_tokens,), generator=gen).tolist()
    stored_prompt = prefix + torch.randint(3, 1024, (40,), generator=gen).tolist()
    prompt = prefix + torch.randint(3, 1024, (40,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), prefix_tokens + 256)

        def llm(url: str | None = None, role: str = "kv_both", load_mode: str = "async"):
            kv = None
            if url is not None:
                kv = {
                    "kv_connector": "StoreConnector",
                    "kv_role": role,
                    "kv_connector_extra_config": {**extra_config(url), "load_mode": load_mode},
                }
            return LLM(tmp, kv_transfer_config=kv, kv_cache_memory=256 << 20)

        runs = {"recompute": llm()}
        for name, url in urls.items():
            writer = llm(url, "kv_producer")
            writer.generate([stored_prompt], params, use_tqdm=False)  # returns once stored
            writer.llm_engine.shutdown()
            for mode in ("async", "sync"):
                runs[f"{name}, {mode} load"] = llm(url, "kv_consumer", mode)
        ttfts: dict[str, list[float]] = {name: [] for name in runs}
        computed, tokens = {}, set()
        for name, engine in runs.items():  # warm-up, then every run measures each row in turn
            tokens.add(time_to_first_token(engine, prompt, params)[1])
            computed[name] = engine.llm_engine.get_stats().num_prompt_tokens
        for _ in range(repeats):
            for name, engine in runs.items():
                ttft, token = time_to_first_token(engine, prompt, params)
                ttfts[name].append(ttft)
                tokens.add(token)
        medians = {name: statistics.median(times) for name, times in ttfts.items()}
        print(f"  {'':<22} {'TTFT median':>11} {'vs recompute':>12} {'tokens computed':>15}")
        for name, engine in runs.items():
            per_run = (engine.llm_engine.get_stats().num_prompt_tokens - computed[name]) // repeats
            print(
                f"  {name:<22} {medians[name] * 1e3:>8.1f} ms "
                f"{medians['recompute'] / medians[name]:>11.1f}x {per_run:>15}",
                flush=True,
            )
            engine.llm_engine.shutdown()
        assert len(tokens) == 1, "the first token differs between runs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--redis-url", default=None, help="use this server (default: start one)")
    ap.add_argument(
        "--mooncake-url",
        default=None,
        help="use this master, whose clients lend memory (default: start a master and a "
        "mooncake_client lending 1 GiB)",
    )
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller batches")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("pagedkv.engine.llm_engine").setLevel(logging.ERROR)  # no tokenizer: fine
    procs: list[subprocess.Popen] = []
    try:
        redis_url, mooncake_url = args.redis_url, args.mooncake_url
        if redis_url is None:
            started, redis_url = start_redis()
            procs += started
        if mooncake_url is None:
            started, mooncake_url = start_mooncake(1 << 30)
            procs += started
        print(
            f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads; stores {redis_url}, "
            f"{mooncake_url}"
        )
        batch_sizes, repeats = ([16], 3) if args.quick else ([16, 32, 64], 7)
        print(f"== put/get of 2 MiB blocks, Redis (medians of {repeats}) ==")
        bench_redis_put_get(redis_url, batch_sizes, repeats)
        print(f"== put/get of 2 MiB blocks, Mooncake (medians of {repeats}) ==")
        bench_mooncake_put_get(mooncake_url, batch_sizes, repeats)
        prefix = 2048 if args.quick else 4096
        print(f"== TTFT with a {prefix}-token prefix in the store vs recomputing it ==")
        with tempfile.TemporaryDirectory() as store_dir:
            urls = {"redis": redis_url, "file": f"file://{store_dir}", "mooncake": mooncake_url}
            bench_ttft(urls, prefix, 3 if args.quick else 5)
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    finally:
        for proc in reversed(procs):
            proc.kill()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
