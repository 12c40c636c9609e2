"""``pagedkv bench throughput``: offline ``LLM.generate`` over a synthetic workload.

Sampling as in vLLM's throughput benchmark: temperature 1, EOS ignored (exact output lengths).
One short request warms the engine up first; the prefix cache is reset after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from pagedkv.engine.engine_args import EngineArgs
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.entrypoints.bench.datasets import add_dataset_args, sample_requests


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    g = parser.add_argument_group("output")
    g.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(parser)


def run_throughput(args: argparse.Namespace) -> None:
    from pagedkv.engine.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**dataclasses.asdict(engine_args))
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    prefix_len = args.prefix_len if args.dataset == "shared-prefix" else 0
    if prefix_len + args.input_len + args.output_len > engine.max_model_len:
        sys.exit(
            f"pagedkv bench throughput: prompts of {prefix_len + args.input_len} tokens plus "
            f"{args.output_len} output tokens exceed max_model_len {engine.max_model_len}"
        )
    try:
        requests = sample_requests(
            args.dataset,
            args.num_prompts,
            args.input_len,
            args.output_len,
            vocab_size=engine.vocab_size,
            seed=args.seed,
            prefix_len=prefix_len,
            exclude_token_ids=tokenizer.all_special_ids if tokenizer is not None else (),
        )
    except ValueError as e:
        sys.exit(f"pagedkv bench throughput: {e}")
    params = [
        SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=r.output_len) for r in requests
    ]
    prompts = [r.prompt_token_ids for r in requests]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    engine.reset_prefix_cache()

    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start

    num_input = sum(len(p) for p in prompts)
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "model": str(engine_args.model_path),
        "dataset": args.dataset,
        "num_requests": len(requests),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefix_len": prefix_len,
        "elapsed_time": elapsed,
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "requests_per_second": len(requests) / elapsed,
        "input_tokens_per_second": num_input / elapsed,
        "output_tokens_per_second": num_output / elapsed,
        "total_tokens_per_second": (num_input + num_output) / elapsed,
        "num_preemptions": engine.get_stats().num_preemptions,
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['input_tokens_per_second']:.1f} input tok/s, "
        f"{result['output_tokens_per_second']:.1f} output tok/s "
        f"({len(requests)} requests, {num_input} input + {num_output} output tokens "
        f"in {elapsed:.2f} s)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
