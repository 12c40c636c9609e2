#!/usr/bin/env python
"""pagedkv's LLM.generate against transformers on the HF-peer workload, in one invocation.

Workload and model come from the hf_peer anchor (``workload.py``: 64 prompts of 64-512 tokens,
128 new tokens each, greedy, EOS ignored; ``make_tiny_llama.py``: a 19M-parameter Llama, seed
1234). transformers runs through the anchor's own ``bench_hf.py`` functions: static ``generate``
in left-padded batches of 16, and its continuous batching manager (a fresh one per run).
fp32 (``--dtype bfloat16``: both in bf16), 2 torch threads. Each timed run waits for a quiet
machine and is rerun when other processes took more than ``--quiet-threshold`` of it (the
anchor's method); medians reported.

Also: ``breakdown``, ms per decode step with all 64 requests decoding (GEMM / attention / other,
with the compiled CPU kernels and with ``--enforce-eager``'s torch ops) and the GEMM-only
floor of those steps; ``floor``, the GEMM-only floor of a whole run (its GEMM shapes replayed
right after each of our timed runs, so that each pair meets the same machine: the median of the
pairs' ratios is quoted; ``step_breakdown.py``) against our wall time, and the same with the
run's KV-read floor added (the K/V bytes its attention must read, at the streaming read
bandwidth measured right after each run); ``llamacpp``,
llama.cpp through the llamacpp anchor's harness on a GGUF conversion of the same weights
(``--llamacpp-gguf``; skipped when llama-cpp-python is not installed or no GGUF is given).

    python benchmarks/throughput.py --anchor-dir ../hf_peer             # ~6 min on a quiet box
    python benchmarks/throughput.py --anchor-dir ../hf_peer --modes ours,static --runs 1
    python benchmarks/throughput.py --anchor-dir ../hf_peer --tensor-parallel-size 2 --runs 1

``--tensor-parallel-size N`` runs only ``tp_throughput.py``'s comparison: TP 1 against TP N.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from step_breakdown import (  # noqa: E402
    decode_breakdown,
    record_run,
    replay_gemms,
    streaming_read_bandwidth,
)
from tp_throughput import compare_tp  # noqa: E402

DEFAULT_ANCHOR = os.path.join(HERE, "..", "..", "shared", "anchors", "hf_peer")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run_llamacpp(gguf: str | None, anchor: str, args) -> dict | str:
    """llama.cpp batched (64 slots) and single-request figures, or why they were skipped."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (see the llamacpp anchor's README)"
    if gguf is None:
        return "no --llamacpp-gguf given"
    sys.path.insert(0, os.path.join(os.path.dirname(anchor), "llamacpp"))
    import bench_llamacpp as lc  # noqa: E402  (the llamacpp anchor's harness)
    import workload as wl  # noqa: E402

    prompts, new = wl.throughput_requests(), wl.MAX_NEW_TOKENS
    eng = lc.Engine(gguf, args.threads)
    slots = wl.NUM_REQUESTS
    ctx = eng.context(slots * 768, slots, 2048, 512, "f32", "off", False)
    batch = lc.Batch(2048)
    lc.run_batched(eng, ctx, batch, lc.WARMUP_PROMPTS, 4, slots, 2048)
    times = []
    for _ in range(args.runs):
        (dt, outputs, _stats), _cpu = lc.measured(
            lambda: lc.run_batched(eng, ctx, batch, prompts, new, slots, 2048), args
        )
        times.append(dt)
    out: dict = dict(median_s=statistics.median(times), times_s=times, outputs=outputs)
    out["out_tok_per_s"] = wl.NUM_REQUESTS * new / out["median_s"]
    lc.L.llama_free(ctx)
    ctx = eng.context(1024, 1, 1024, 512, "f32", "off", False)
    batch = lc.Batch(1024)
    lc.run_single_latency(eng, ctx, batch, wl.single_request(), 8)
    runs = [
        lc.measured(lambda: lc.run_single_latency(eng, ctx, batch, wl.single_request(), new), args)[
            0
        ]
        for _ in range(args.runs)
    ]
    for key in ("ttft", "decode_per_token"):
        out[f"single_{key}_ms"] = statistics.median(r[key] for r in runs) * 1e3
    lc.L.llama_free(ctx)
    return out


def run_ours_single(llm, prompt: list[int], new_tokens: int) -> dict:
    """TTFT and inter-token times of one request, from the engine's own step loop."""
    from pagedkv import SamplingParams
    from pagedkv.engine.request_input import RequestInput

    engine = llm.llm_engine
    engine.reset_prefix_cache()  # a cold start, as for transformers: no reused prompt blocks
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request(RequestInput(prompt, params))
    stamps: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps.extend([time.perf_counter()] * (len(out.outputs[0].token_ids) - len(stamps)))
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return dict(
        ttft=stamps[0] - t0,
        decode_per_token=(stamps[-1] - stamps[0]) / (len(stamps) - 1),
        itl_median=statistics.median(itl),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--anchor-dir", default=os.environ.get("PAGEDKV_HF_ANCHOR", DEFAULT_ANCHOR))
    ap.add_argument(
        "--model-dir",
        default=None,
        help="the tiny Llama (default: <anchor-dir>/tiny-llama, built if missing)",
    )
    ap.add_argument("--modes", default="ours,static,cb,single,breakdown,floor,llamacpp")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--enforce-eager", action="store_true", help="our engine without kernels")
    ap.add_argument("--llamacpp-gguf", default=None, help="the tiny Llama as an F32 GGUF")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.05,
        help="rerun a timed run when other processes used more than this share of "
        "the machine during it (1.0 disables)",
    )
    ap.add_argument("--max-wait", type=float, default=300)
    ap.add_argument("--retries", type=int, default=4)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="compare TP 1 with TP N (ranks one per core) instead of the other modes",
    )
    args = ap.parse_args()
    anchor = os.path.abspath(args.anchor_dir)
    if not os.path.exists(os.path.join(anchor, "bench_hf.py")):
        sys.exit(
            f"no bench_hf.py in {anchor}: pass --anchor-dir (a copy of shared/anchors/hf_peer)"
        )
    model_dir = os.path.abspath(args.model_dir or os.path.join(anchor, "tiny-llama"))
    if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
        subprocess.run(
            [sys.executable, os.path.join(anchor, "make_tiny_llama.py"), model_dir], check=True
        )
    sys.path.insert(0, anchor)
    import bench_hf  # noqa: E402  (the anchor's transformers benchmark)
    import workload as wl  # noqa: E402

    from pagedkv import LLM, SamplingParams

    bench_hf.MODEL_DIR = model_dir
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # bench_hf's continuous-batching settings, as recorded in the anchor's notes.
    for key, value in dict(
        cb_page_size=256,
        cb_num_blocks=256,
        cb_max_batch_tokens=2048,
        cb_max_requests=None,
        cb_reuse_manager=False,
        cb_e2e=False,
    ).items():
        setattr(args, key, value)
    modes = args.modes.split(",")
    prompts = wl.throughput_requests()
    assert wl.fingerprint() == "18a9b286baf78bea", "not the anchor's workload"
    total_out = wl.NUM_REQUESTS * wl.MAX_NEW_TOKENS
    results: dict = dict(
        machine=dict(nproc=os.cpu_count(), torch=torch.__version__, threads=torch.get_num_threads())
    )
    if args.tensor_parallel_size is not None:
        greedy = SamplingParams(temperature=0, max_tokens=wl.MAX_NEW_TOKENS, ignore_eos=True)
        results["tensor_parallel"] = compare_tp(
            model_dir, prompts, greedy, args, total_out, bench_hf, run_ours_single, wl
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return
    outputs: dict[str, list[list[int]]] = {}

    def summarize(name: str, times: list[float]) -> None:
        med = statistics.median(times)
        results[name] = dict(times_s=times, median_s=med, out_tok_per_s=total_out / med)
        print(
            f"{name}: median {med:.2f}s, {total_out / med:.0f} output tok/s  runs={times}",
            flush=True,
        )

    llm = None
    dtype = DTYPES[args.dtype]
    greedy = SamplingParams(temperature=0, max_tokens=wl.MAX_NEW_TOKENS, ignore_eos=True)
    if {"ours", "single", "breakdown", "floor"} & set(modes):
        start = time.perf_counter()
        llm = LLM(model_dir, dtype=args.dtype, device="cpu", enforce_eager=args.enforce_eager)
        results["startup_s"] = time.perf_counter() - start
        print(f"pagedkv engine ready in {results['startup_s']:.1f} s", flush=True)
    shapes, kv_bytes = None, 0
    if "floor" in modes:  # from one untimed run: recording costs a little per call
        llm.llm_engine.reset_prefix_cache()
        shapes, kv_bytes = record_run(
            lambda: llm.generate(prompts, greedy, use_tqdm=False),
            llm.llm_engine.model_runner.attn_backend,
        )
    replays: list[float] = []
    bandwidths: list[float] = []
    if "ours" in modes:
        # Warm-up over the measured shapes: the whole workload, a few tokens each.
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        times = []
        for _ in range(args.runs):
            # Every attempt starts with a cold prefix cache, like HF's fresh manager per run.
            outs, cpu = bench_hf.measured(
                lambda: llm.generate(prompts, greedy, use_tqdm=False),
                args,
                setup=lambda attempt: llm.llm_engine.reset_prefix_cache(),
            )
            times.append(cpu["wall_s"])
            if shapes is not None:  # the floors, measured in the same phase of the machine
                replays.append(replay_gemms(shapes, dtype))
                bandwidths.append(streaming_read_bandwidth())
        outputs["ours"] = [o.outputs[0].token_ids for o in outs]
        summarize("pagedkv", times)
    if shapes is not None:
        replays = replays or [replay_gemms(shapes, dtype) for _ in range(args.runs)]
        bandwidths = bandwidths or [streaming_read_bandwidth() for _ in range(args.runs)]
        floor = statistics.median(replays)
        num_gemms = sum(shapes.values())
        results["gemm_floor"] = dict(seconds=floor, replays_s=replays, num_gemms=num_gemms)
        kv_floors = [kv_bytes / bw for bw in bandwidths]
        results["kv_read_floor"] = dict(
            seconds=statistics.median(kv_floors),
            bytes=kv_bytes,
            read_bytes_per_s=bandwidths,
            seconds_each=kv_floors,
        )
        print(
            f"GEMM-only floor of one run: {floor:.2f} s, median of {len(replays)} replays "
            f"({', '.join(f'{r:.2f}' for r in replays)}; {num_gemms} GEMMs)\n"
            f"KV-read floor of one run: {kv_bytes / 1e9:.1f} GB of K/V at "
            f"{statistics.median(bandwidths) / 1e9:.1f} GB/s (streaming read, "
            f"{', '.join(f'{b / 1e9:.1f}' for b in bandwidths)}) = "
            f"{statistics.median(kv_floors):.2f} s"
        )
    if "breakdown" in modes:
        eager = LLM(model_dir, dtype=args.dtype, device="cpu", enforce_eager=True)
        for name, engine in (("compiled", llm), ("enforce_eager", eager)):
            engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
            rows = [decode_breakdown(engine, prompts, greedy) for _ in range(args.runs)]
            results[f"breakdown_{name}"] = row = {
                k: statistics.median(r[k] for r in rows) for k in rows[0]
            }
            print(
                f"decode step at batch {row['batch']} ({name}): {row['step_ms']:.1f} ms = "
                f"GEMM {row['gemm_ms']:.1f} + attention {row['attention_ms']:.1f} + "
                f"other {row['other_ms']:.1f}; GEMM-only floor {row['gemm_floor_ms']:.1f} ms, "
                f"KV-read floor {row['kv_read_floor_ms']:.1f} ms",
                flush=True,
            )
        del eager
    if "llamacpp" in modes:
        lc = run_llamacpp(args.llamacpp_gguf, anchor, args)
        results["llamacpp"] = lc
        if isinstance(lc, str):
            print(f"llama.cpp: skipped ({lc})")
        else:
            print(
                f"llama.cpp batched: {lc['out_tok_per_s']:.0f} output tok/s; single request "
                f"TTFT {lc['single_ttft_ms']:.1f} ms, "
                f"{lc['single_decode_per_token_ms']:.2f} ms/token"
            )
    hf_model = None
    if {"static", "cb", "single"} & set(modes):
        hf_model = bench_hf.load_model("sdpa").to(dtype)
    if "static" in modes:
        bench_hf.run_static(hf_model, bench_hf.WARMUP_PROMPTS, 2, 4)
        times = []
        for _ in range(args.runs):
            (dt, outs), _cpu = bench_hf.measured(
                lambda: bench_hf.run_static(
                    hf_model, prompts, wl.STATIC_BATCH_SIZE, wl.MAX_NEW_TOKENS
                ),
                args,
            )
            times.append(dt)
        outputs["static"] = outs
        summarize("hf_static", times)
    if "cb" in modes:
        r = bench_hf.bench_cb(hf_model, prompts, args)
        outputs["cb"] = r["outs"]
        summarize("hf_continuous_batching", r["times"])
    if "single" in modes:
        prompt = wl.single_request()
        run_ours_single(llm, prompt, 8)
        ours = [
            bench_hf.measured(lambda: run_ours_single(llm, prompt, wl.MAX_NEW_TOKENS), args)[0]
            for _ in range(args.runs)
        ]
        bench_hf.run_single(hf_model, prompt, 8)
        theirs = [
            bench_hf.measured(
                lambda: bench_hf.run_single(hf_model, prompt, wl.MAX_NEW_TOKENS), args
            )[0]
            for _ in range(args.runs)
        ]
        for name, runs in (("pagedkv_single", ours), ("hf_single", theirs)):
            results[name] = {
                k: statistics.median(r[k] for r in runs) * 1e3
                for k in ("ttft", "decode_per_token", "itl_median")
            }
            print(
                f"{name}: TTFT {results[name]['ttft']:.1f} ms, "
                f"{results[name]['decode_per_token']:.2f} ms/token",
                flush=True,
            )

    print(
        f"\n== pagedkv vs transformers (tiny Llama 19M, {args.dtype}, "
        f"{torch.get_num_threads()} threads, 64 requests x 128 new tokens)"
    )
    if "pagedkv" in results:
        for peer in ("hf_static", "hf_continuous_batching"):
            if peer in results:
                ratio = results["pagedkv"]["out_tok_per_s"] / results[peer]["out_tok_per_s"]
                results[f"ratio_vs_{peer}"] = ratio
                print(
                    f"output tok/s  pagedkv {results['pagedkv']['out_tok_per_s']:8.0f}   "
                    f"{peer} {results[peer]['out_tok_per_s']:8.0f}   ratio {ratio:.2f}x"
                )
    if "pagedkv" in results and "gemm_floor" in results:
        pairs = [
            t / r for t, r in zip(results["pagedkv"]["times_s"], results["gemm_floor"]["replays_s"])
        ]
        ratio = statistics.median(pairs)
        results["ratio_to_gemm_floor"] = ratio
        results["ratio_to_gemm_floor_pairs"] = pairs
        print(
            f"pagedkv wall time / GEMM-only floor: {ratio:.2f}x, the median of each run against "
            f"the replay right after it ({', '.join(f'{p:.2f}' for p in pairs)})"
        )
        kv_floors = results["kv_read_floor"]["seconds_each"]
        pairs = [
            t / (r + kv)
            for t, r, kv in zip(
                results["pagedkv"]["times_s"], results["gemm_floor"]["replays_s"], kv_floors
            )
        ]
        ratio = statistics.median(pairs)
        results["ratio_to_gemm_and_kv_floor"] = ratio
        print(
            f"pagedkv wall time / (GEMM-only + KV-read floor): {ratio:.2f}x "
            f"({', '.join(f'{p:.2f}' for p in pairs)})"
        )
    lc = results.get("llamacpp")
    if "pagedkv" in results and isinstance(lc, dict):
        ratio = results["pagedkv"]["out_tok_per_s"] / lc["out_tok_per_s"]
        results["ratio_vs_llamacpp_batched"] = ratio
        print(f"output tok/s  pagedkv vs llama.cpp batched: ratio {ratio:.2f}x")
    if "pagedkv_single" in results:
        ours, theirs = results["pagedkv_single"], results["hf_single"]
        print(
            f"single request: TTFT {ours['ttft']:.1f} ms vs {theirs['ttft']:.1f} ms, "
            f"decode {ours['decode_per_token']:.2f} vs {theirs['decode_per_token']:.2f} ms/token"
        )
        if isinstance(lc, dict):
            print(
                f"single request vs llama.cpp: TTFT {ours['ttft']:.1f} vs "
                f"{lc['single_ttft_ms']:.1f} ms, decode {ours['decode_per_token']:.2f} vs "
                f"{lc['single_decode_per_token_ms']:.2f} ms/token"
            )
    if isinstance(lc, dict):
        outputs["llamacpp"] = lc.pop("outputs")
    peers = {
        "static": "transformers static",
        "cb": "transformers continuous batching",
        "llamacpp": "llama.cpp batched",
    }
    if "ours" in outputs:
        for peer, name in peers.items():
            if peer in outputs:
                same = sum(a == b for a, b in zip(outputs["ours"], outputs[peer]))
                results[f"identical_to_{peer}"] = same
                print(f"greedy outputs identical to {name}: {same}/64 requests")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
