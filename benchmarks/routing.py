#!/usr/bin/env python
"""Routing benchmark: the proxy's policies, and sglang-router's cache_aware, in front of the
same replicas; and conditional disaggregation against one instance.

(a) replicas: ``--replicas`` (3) ``pagedkv serve`` processes of the built-in model, each
    publishing KV events and registered with the proxy, fresh (empty caches) for every run.
    A seeded multi-tenant workload: ``--prefixes`` system prompts (~150 tokens of Python from
    the standard library) × ``--users`` questions (~20-60 tokens), shuffled, sent open-loop
    (Poisson arrivals at ``--rate`` per second), streamed with usage, 16 output tokens each.
    Per policy: prefix-cache hit rate in tokens (the replicas' own counters), its ratio to the
    oracle (one cache that saw every earlier request: each prefix computed once), the largest
    share of prompt tokens one replica took, TTFT p50/p99 and output throughput. Peer:
    ``sglang-router`` (``pip install sglang-router``; skipped when not installed) with
    ``--policy cache_aware`` on the same replicas.
(b) pd: 1P1D (P2P connector, PUT_ASYNC) behind the proxy, prompts of 40-200 tokens, each
    distinct, max_tokens=1, sent one at a time: TTFT without and with ``--disagg-threshold``
    against one plain instance.

Medians over ``--repeats`` runs; the machine's load is printed.

    python benchmarks/routing.py                  # both parts (~6 min on 2 cores)
    python benchmarks/routing.py --part replicas --repeats 1 --rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.pd_instances import Processes, free_port, machine_info  # noqa: E402
from pagedkv.engine.engine_args import DEFAULT_MODEL_PATH  # noqa: E402
from pagedkv.kv_cache.block_hash import BlockHasher  # noqa: E402

MODEL = "default_model"
OUTPUT_LEN = 16
BLOCK_SIZE = 16
POLICIES = ("round_robin", "least_loaded", "kv_aware", "sglang cache_aware")


def wait_ready(url: str, path: str = "/health", timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url}{path} not ready in {timeout_s:.0f} s")


def events_config() -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{free_port()}",
            "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        }
    )


def counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("pagedkv:")
    }


# ============================================================================ workload
def python_snippets(count: int, seed: int) -> list[str]:
    """Source from the standard library (what the built-in model was trained on)."""
    rng = random.Random(seed)
    files = sorted(Path(os.__file__).parent.glob("*.py"))
    snippets = []
    while len(snippets) < count:
        lines = rng.choice(files).read_text(errors="ignore").splitlines()
        start = rng.randrange(max(1, len(lines) - 40))
        snippets.append("\n".join(lines[start : start + 40]))
    return snippets


def multi_tenant(tokenizer, prefixes: int, users: int, seed: int) -> list[str]:
    """``prefixes`` system prompts of ~150 tokens × ``users`` questions of ~20-60 tokens, as
    text (sglang-router takes no token ids)."""
    rng = random.Random(seed)
    texts = python_snippets(prefixes + prefixes * users, seed)

    def cut(text: str, num_tokens: int) -> str:
        return tokenizer.decode(tokenizer.encode(text)[:num_tokens])

    systems = [cut(t, 150) for t in texts[:prefixes]]
    prompts = [
        f"{system}\n{cut(texts[prefixes + p * users + u], rng.randrange(20, 60))}"
        for p, system in enumerate(systems)
        for u in range(users)
    ]
    rng.shuffle(prompts)
    return prompts


def oracle_hit_tokens(prompts: list[list[int]]) -> int:
    """Hits of one cache that saw every earlier prompt (each prefix computed once)."""
    hasher = BlockHasher(BLOCK_SIZE)
    seen: set[bytes] = set()
    hits = 0
    for prompt in prompts:
        hashes = hasher.hash_token_ids(prompt[: len(prompt) - 1])
        run = 0
        while run < len(hashes) and hashes[run] in seen:
            run += 1
        hits += run * BLOCK_SIZE
        seen.update(hasher.hash_token_ids(prompt))
    return hits


async def one_request(client: httpx.AsyncClient, url: str, prompt: str | list[int]) -> dict:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": OUTPUT_LEN,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            return {"ok": False, "error": (await r.aread())[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                usage = event["usage"]
    return {"ok": usage is not None, "ttft": ttft, "usage": usage, "end": time.perf_counter()}


async def open_loop(url: str, prompts: list[str], rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()
        tasks, at = [], 0.0
        for prompt in prompts:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(client, url, prompt)))
            at += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
    failed = [r for r in results if not r["ok"]]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:2]}")
    duration = max(r["end"] for r in results) - start
    ttfts = sorted(r["ttft"] for r in results)
    return {
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1e3,
        "throughput": len(results) * OUTPUT_LEN / duration,
    }


# ============================================================================ (a) replicas
def run_replicas(policy: str, args, prompts: list[str], seed: int, log_dir: Path) -> dict:
    procs = Processes(log_dir)
    try:
        registry_port = free_port()
        urls = [
            procs.serve(
                f"{policy}-R{i}".replace(" ", "_"),
                free_port(),
                "--registry",
                f"127.0.0.1:{registry_port}",
                "--kv-events-config",
                events_config(),
            )  # fmt: skip
            for i in range(args.replicas)
        ]
        port = free_port()
        if policy.startswith("sglang"):
            metrics_port = free_port()
            procs.start(
                "sglang-router",
                [
                    sys.executable, "-m", "sglang_router.launch_router",
                    "--worker-urls", *urls, "--policy", "cache_aware",
                    "--host", "127.0.0.1", "--port", str(port),
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                ],
            )  # fmt: skip
        else:
            procs.start(
                f"proxy-{policy}",
                [
                    sys.executable, "-m", "pagedkv", "proxy", "--port", str(port),
                    "--registry-port", str(registry_port), "--routing", policy,
                    "--load-weight", str(args.load_weight),
                ],
            )  # fmt: skip
        for url in urls:
            wait_ready(url)
        proxy_url = f"http://127.0.0.1:{port}"
        if policy.startswith("sglang"):
            wait_ready(proxy_url, "/v1/models")
        else:
            deadline = time.monotonic() + 60
            while httpx.get(proxy_url + "/health").json()["replica"] < len(urls):
                if time.monotonic() > deadline:
                    raise RuntimeError("replicas did not register")
                time.sleep(0.2)
        result = asyncio.run(open_loop(proxy_url, prompts, args.rate, seed))
        per_replica = [counters(url) for url in urls]
        queries = [c.get("pagedkv:prefix_cache_queries_total", 0.0) for c in per_replica]
        hits = sum(c.get("pagedkv:prefix_cache_hits_total", 0.0) for c in per_replica)
        result["hit_rate"] = hits / sum(queries)
        result["max_share"] = max(queries) / sum(queries)
        return result
    finally:
        procs.stop()


def part_replicas(args, log_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    prompts = multi_tenant(tokenizer, args.prefixes, args.users, args.seed)
    token_ids = [tokenizer.encode(p) for p in prompts]
    total = sum(len(t) for t in token_ids)
    oracle = oracle_hit_tokens(token_ids) / total
    policies = [p for p in POLICIES if not p.startswith("sglang") and p in args.policies]
    if "sglang" in args.policies:
        if _has_module("sglang_router"):
            policies.append("sglang cache_aware")
        else:
            print("sglang-router is not installed: its row is skipped (pip install sglang-router)")
    print(
        f"\n(a) {args.replicas} replicas, {len(prompts)} requests ({args.prefixes} prefixes x "
        f"{args.users} users, {total} prompt tokens), Poisson {args.rate}/s, "
        f"{OUTPUT_LEN} output tokens; oracle hit rate {oracle:.3f}"
    )
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for repeat in range(args.repeats):
        for policy in policies:  # interleaved, so load on the machine hits each alike
            result = run_replicas(policy, args, prompts, args.seed + repeat, log_dir)
            runs[policy].append(result)
            print(f"  run {repeat + 1} {policy:>18}: " + _fmt(result, oracle), flush=True)
    print(f"\n  medians of {args.repeats} (load {os.getloadavg()[0]:.1f}):")
    medians = {p: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for p, rs in runs.items()}
    for policy, m in medians.items():
        print(f"  {policy:>18}: " + _fmt(m, oracle))
    if "kv_aware" not in medians or "round_robin" not in medians:
        return
    kv, rr = medians["kv_aware"], medians["round_robin"]
    print(
        f"\n  kv_aware: {kv['hit_rate'] / oracle:.2f} of the oracle (target >= 0.9), "
        f"max share {kv['max_share']:.2f} (<= 0.6), "
        f"TTFT p50 {kv['ttft_p50_ms'] / rr['ttft_p50_ms']:.2f}x round_robin's (<= 0.6)"
    )
    if "sglang cache_aware" in medians:
        sg = medians["sglang cache_aware"]
        print(
            f"  vs sglang cache_aware: hit rate {kv['hit_rate']:.3f} vs {sg['hit_rate']:.3f}, "
            f"max share {kv['max_share']:.2f} vs {sg['max_share']:.2f}"
        )


def _fmt(r: dict, oracle: float) -> str:
    return (
        f"hit rate {r['hit_rate']:.3f} ({r['hit_rate'] / oracle:.2f} of oracle), "
        f"max share {r['max_share']:.2f}, TTFT p50 {r['ttft_p50_ms']:.1f} ms "
        f"p99 {r['ttft_p99_ms']:.1f} ms, {r['throughput']:.0f} out tok/s"
    )


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ============================================================================ (b) pd
async def _ttfts(url: str, prompts: list[list[int]]) -> list[float]:
    """One at a time: each request's TTFT (max_tokens=1: its whole latency)."""
    out = []
    async with httpx.AsyncClient() as client:
        for prompt in prompts:
            t0 = time.perf_counter()
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            r = await client.post(url + "/v1/completions", json=body, timeout=60)
            r.raise_for_status()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def part_pd(args, log_dir: Path) -> None:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 4000) for _ in range(rng.randrange(40, 200))] for _ in range(30)]
    procs = Processes(log_dir)
    try:
        registry_port = free_port()
        single = procs.serve("single", free_port())
        for role in ("kv_producer", "kv_consumer"):
            kv = {
                "kv_connector": "P2pConnector", "kv_role": role, "kv_port": free_port(),
                "kv_connector_extra_config": {
                    "send_type": "PUT_ASYNC", "proxy_ip": "127.0.0.1",
                    "proxy_port": registry_port, "proxy_heartbeat_s": 0.5,
                },
            }  # fmt: skip
            wait_ready(procs.serve(role, free_port(), "--kv-transfer-config", json.dumps(kv)))
        wait_ready(single)
        setups = {"single instance": (single, None)}
        setups["1P1D"] = (None, 0)
        setups["1P1D --disagg-threshold 256"] = (None, 256)
        results: dict[str, list[float]] = {name: [] for name in setups}
        print(f"\n(b) 1P1D vs one instance, {len(prompts)} prompts of 40-200 tokens, max_tokens=1")
        for repeat in range(args.repeats):
            for name, (url, threshold) in setups.items():
                proxy = None
                if url is None:  # a proxy on the registry the P and D heartbeat to
                    port = free_port()
                    proxy = procs.start(
                        f"proxy-{threshold}-{repeat}",
                        [
                            sys.executable, "-m", "pagedkv", "proxy", "--port", str(port),
                            "--registry-port", str(registry_port),
                            "--disagg-threshold", str(threshold),
                        ],
                    )  # fmt: skip
                    url = f"http://127.0.0.1:{port}"
                    _wait_pd(url)
                asyncio.run(_ttfts(url, prompts[:3]))  # warm-up
                results[name].append(statistics.median(asyncio.run(_ttfts(url, prompts))))
                if proxy is not None:
                    proxy.terminate()
                    proxy.wait(timeout=20)
        base = statistics.median(results["single instance"])
        print(f"  medians of {args.repeats} runs' medians (load {os.getloadavg()[0]:.1f}):")
        for name, medians in results.items():
            median = statistics.median(medians)
            print(f"  {name:>28}: TTFT {median:.1f} ms ({median / base - 1:+.1%} vs one instance)")
    finally:
        procs.stop()


def _wait_pd(url: str) -> None:
    wait_ready(url)
    deadline = time.monotonic() + 30
    while (h := httpx.get(url + "/health").json())["prefill"] < 1 or h["decode"] < 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"P and D did not register: {h}")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["all", "replicas", "pd"], default="all")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second")
    parser.add_argument("--load-weight", type=float, default=32.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--policies",
        default="round_robin,least_loaded,kv_aware,sglang",
        help="comma-separated, of round_robin, least_loaded, kv_aware, sglang",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.policies = args.policies.split(",")
    print(machine_info())
    with tempfile.TemporaryDirectory(prefix="routing-bench-") as tmp:
        log_dir = Path(tmp)
        if args.part in ("all", "replicas"):
            part_replicas(args, log_dir)
        if args.part in ("all", "pd"):
            part_pd(args, log_dir)


if __name__ == "__main__":
    main()
