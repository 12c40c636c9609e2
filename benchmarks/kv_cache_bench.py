#!/usr/bin/env python
"""pagedkv's KVCacheManager against vLLM 0.33's, side by side on the same seeded traces.

The traces (W1 churn, W1b interleaved, W2 lookup, W3 hashing, W4 hybrid) and the vLLM adapter
come from the vLLM anchor folder (``workloads.py``, ``bench_vllm_kvcache.py``, a ``venv`` with
vLLM 0.33 made by its ``setup_venv.sh``). Ours runs in this process; vLLM runs in its venv as a
subprocess, right after ours on the same workload. Rates are per CPU-second of the benchmarking
process (robust to other jobs on a shared machine); the ratio is ours / vLLM.

    python benchmarks/kv_cache_bench.py --anchor-dir ../vllm_kv            # full, ~5 min
    python benchmarks/kv_cache_bench.py --anchor-dir ../vllm_kv --quick    # ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ANCHOR = os.path.join(HERE, "..", "..", "shared", "anchors", "vllm_kv")
TRACE_WORKLOADS = ("W1", "W1b", "W2", "W4")


def rate(result: dict, name: str) -> tuple[str, float]:
    """The workload's headline rate per CPU-second: requests, or hit tokens for lookups."""
    cpu = result["median_cpu_seconds"]
    if name == "W2":
        return "hit tokens/cpu-s", result["hit_tokens"] / cpu
    return "requests/cpu-s", result["counts"]["arrive"] / cpu


def fingerprint(result: dict) -> tuple:
    snap = result["snapshot"]
    return result["hit_tokens"], result["new_blocks"], snap["free_blocks"], snap["cached_blocks"]


def run_vllm(args, only: str) -> dict | None:
    python = args.vllm_python or os.path.join(args.anchor_dir, "venv", "bin", "python")
    if args.no_vllm or not os.path.exists(python):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "vllm.json")
        cmd = [
            python,
            "bench_vllm_kvcache.py",
            "--only",
            only,
            "--repeats",
            str(args.repeats),
            "--hash-algos",
            "sha256,xxhash",
            "--out",
            out,
        ]
        if args.quick:
            cmd.append("--quick")
        subprocess.run(
            cmd,
            cwd=args.anchor_dir,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with open(out) as f:
            return json.load(f)["workloads"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--anchor-dir",
        default=os.environ.get("PAGEDKV_VLLM_ANCHOR", DEFAULT_ANCHOR),
        help="the vLLM anchor folder (workloads.py, bench_vllm_kvcache.py, venv/)",
    )
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vLLM 0.33")
    ap.add_argument("--no-vllm", action="store_true", help="run pagedkv only")
    ap.add_argument("--quick", action="store_true", help="10x smaller traces")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default="W1,W1b,W2,W3,W4")
    args = ap.parse_args()
    args.anchor_dir = os.path.abspath(args.anchor_dir)
    if not os.path.exists(os.path.join(args.anchor_dir, "workloads.py")):
        sys.exit(
            f"no workloads.py in {args.anchor_dir}: pass --anchor-dir (a copy of "
            "shared/anchors/vllm_kv)"
        )
    sys.path[:0] = [args.anchor_dir, HERE]
    import workloads as W  # noqa: E402  (the anchor's neutral traces)
    from kv_cache_adapter import PagedKVAdapter  # noqa: E402

    n = 200 if args.quick else 2000
    builders = {
        "W1": lambda: W.build_w1_churn(num_requests=n),
        "W1b": lambda: W.build_w1b_interleaved(num_requests=n),
        "W2": lambda: W.build_w2_lookup(num_prompts=100 if args.quick else 1000),
        "W4": lambda: W.build_w4_hybrid(num_requests=n),
    }
    rows = []
    for name in args.only.split(","):
        if name == "W3":
            hw = W.build_w3_hash(num_sequences=20 if args.quick else 200)
            ours = W.run_hash_workload(PagedKVAdapter(), hw, "xxhash", args.repeats)
            ours_rate = ours["tokens"] / ours["median_cpu_seconds"]
            theirs = run_vllm(args, "W3")
            peer = theirs["W3"]["sha256"] if theirs else None
            peer_rate = peer["tokens"] / peer["median_cpu_seconds"] if peer else None
            rows.append(
                (
                    name,
                    "tokens hashed/cpu-s (ours xxh3-128 vs vLLM default sha256)",
                    ours_rate,
                    peer_rate,
                    None,
                    None,
                )
            )
            continue
        wl = builders[name]()
        ours = W.run_workload(PagedKVAdapter(), wl, args.repeats, breakdown_pass=False)
        unit, ours_rate = rate(ours, name)
        theirs = run_vllm(args, name)
        peer = theirs[name] if theirs else None
        peer_rate = rate(peer, name)[1] if peer else None
        rows.append(
            (
                name,
                unit,
                ours_rate,
                peer_rate,
                fingerprint(ours),
                fingerprint(peer) if peer else None,
            )
        )
        del wl

    print(
        f"\npagedkv vs vLLM 0.33 KVCacheManager ({'quick' if args.quick else 'full'} traces, "
        f"median of {args.repeats}, per CPU-second of this process)"
    )
    print(f"{'workload':8} {'metric':58} {'pagedkv':>12} {'vLLM':>12} {'ratio':>7}  behaviour")
    for name, unit, ours_rate, peer_rate, fp_ours, fp_peer in rows:
        ratio = f"{ours_rate / peer_rate:6.2f}x" if peer_rate else "    n/a"
        peer = f"{peer_rate:12,.0f}" if peer_rate else f"{'-':>12}"
        if fp_ours is None:
            beh = ""
        elif fp_peer is None:
            beh = f"ours {fp_ours}"
        else:
            beh = ("identical " if fp_ours == fp_peer else "DIFFERENT ") + str(fp_ours)
        print(f"{name:8} {unit:58} {ours_rate:12,.0f} {peer} {ratio}  {beh}")
    print("behaviour = (hit tokens, new blocks, free blocks at end, cached blocks at end)")


if __name__ == "__main__":
    main()
