"""``pagedkv bench throughput``: offline ``LLM.generate`` over a synthetic workload.

Sampling as in vLLM's throughput benchmark: temperature 1, EOS ignored (exact output lengths).
Before the timed run, the same workload runs ``--num-iters-warmup`` times untimed, so every
batch shape the timed run meets has been met (CPU kernels pay their first call per shape);
the first run's figure is reported apart. The prefix cache is reset before each run.

``--json-schema`` constrains every request to the schema (structured outputs: requests end
when their JSON is complete); ``--compare-unconstrained`` then also runs the same prompts
without it, each request generating exactly as many tokens as it did constrained, and prints
the ratio: the cost of the grammar alone. The two then alternate ``--num-pairs`` more times
(each pair close in time, so a machine's load drifts out of the ratio) and the median ratio
of the pairs is reported too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from pagedkv.engine.engine_args import EngineArgs
from pagedkv.entrypoints.bench.datasets import BenchRequest, RequestSampler, add_dataset_args
from pagedkv.sampling_params import SamplingParams, StructuredOutputsParams


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object (a JSON schema)")
    return value


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    g = parser.add_argument_group("runs")
    g.add_argument(
        "--num-iters-warmup",
        type=int,
        default=1,
        help="untimed runs of the whole workload first (default: 1)",
    )
    g.add_argument(
        "--json-schema",
        type=_json_object,
        default=None,
        metavar="SCHEMA",
        help="constrain every request to this JSON schema (structured outputs)",
    )
    g.add_argument(
        "--compare-unconstrained",
        action="store_true",
        help="with --json-schema: also run without it (same prompts and output lengths)",
    )
    g.add_argument(
        "--num-pairs",
        type=int,
        default=2,
        help="with --compare-unconstrained: alternating constrained/unconstrained runs after "
        "the first, for the median ratio (default: 2)",
    )
    g = parser.add_argument_group("output")
    g.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(parser)


def _timed_runs(llm, prompts, params, num_warmup: int, progress: bool) -> tuple[list, dict]:
    """Warm-up runs, then the timed one: its outputs and the timings of all of them."""
    engine = llm.llm_engine
    times = []
    for i in range(num_warmup + 1):
        engine.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=progress and i == num_warmup)
        times.append(time.perf_counter() - start)
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    return outputs, {
        "elapsed_time": times[-1],
        "first_run_elapsed_time": times[0],
        "total_output_tokens": num_output,
        "output_tokens_per_second": num_output / times[-1],
        "first_run_output_tokens_per_second": num_output / times[0],
    }


def _report(label: str, result: dict, num_requests: int, num_input: int) -> None:
    elapsed = result["elapsed_time"]
    num_output = result["total_output_tokens"]
    print(
        f"{label}: {num_requests / elapsed:.2f} requests/s, {num_input / elapsed:.1f} input tok/s, "
        f"{result['output_tokens_per_second']:.1f} output tok/s "
        f"({num_requests} requests, {num_input} input + {num_output} output tokens in "
        f"{elapsed:.2f} s; first run {result['first_run_output_tokens_per_second']:.1f} "
        "output tok/s)"
    )


def _sample_requests(args: argparse.Namespace, engine, tokenizer) -> tuple[int, list[BenchRequest]]:
    """The prefix length and the requests; a ValueError if they do not fit the context."""
    prefix_len = args.prefix_len if args.dataset == "shared-prefix" else 0
    if prefix_len + args.input_len + args.output_len > engine.max_model_len:
        raise ValueError(
            f"prompts of {prefix_len + args.input_len} tokens plus {args.output_len} output "
            f"tokens exceed max_model_len {engine.max_model_len}: lower --input-len, "
            "--output-len or --prefix-len"
        )
    return prefix_len, RequestSampler(
        args.dataset,
        args.input_len,
        args.output_len,
        vocab_size=engine.vocab_size,
        seed=args.seed,
        prefix_len=prefix_len,
        exclude_token_ids=tokenizer.all_special_ids if tokenizer is not None else (),
    ).first(args.num_prompts)


def _report_grammar(engine, result: dict) -> None:
    stats = engine.structured_outputs.compile_stats()
    result["grammar_compile_ms_per_schema"] = 1e3 * stats.compile_seconds / stats.num_compiled
    print(
        f"Grammar: {stats.num_compiled} schema compiled in "
        f"{result['grammar_compile_ms_per_schema']:.2f} ms per schema "
        f"({stats.num_cache_hits} requests served from the grammar cache)"
    )


def _compare_unconstrained(llm, prompts, params, outputs, result: dict, args) -> None:
    """The same prompts without the schema, each request generating exactly as many tokens as
    it did constrained, then ``--num-pairs`` alternating pairs: the ratios go into ``result``."""
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    free = [
        dataclasses.replace(p, structured_outputs=None, max_tokens=n)
        for p, n in zip(params, lengths)
    ]
    _, unconstrained = _timed_runs(llm, prompts, free, args.num_iters_warmup, not args.disable_tqdm)
    num_requests, num_input = result["num_requests"], result["total_input_tokens"]
    _report("Throughput (unconstrained)", unconstrained, num_requests, num_input)
    ratios = [result["output_tokens_per_second"] / unconstrained["output_tokens_per_second"]]
    for _ in range(args.num_pairs):
        pair = [_timed_runs(llm, prompts, p, 0, False)[1] for p in (params, free)]
        ratios.append(pair[0]["output_tokens_per_second"] / pair[1]["output_tokens_per_second"])
    print(
        f"Constrained / unconstrained output tok/s: {ratios[0]:.3f}; median of "
        f"{len(ratios)} pairs {statistics.median(ratios):.3f} "
        f"({', '.join(f'{r:.3f}' for r in ratios)})"
    )
    result["unconstrained"] = unconstrained
    result["constrained_over_unconstrained"] = ratios[0]
    result["constrained_over_unconstrained_pairs"] = ratios


def run_throughput(args: argparse.Namespace) -> None:
    """Raises ValueError (printed on one line by the command) for a workload that cannot run."""
    from pagedkv.engine.llm import LLM

    if args.compare_unconstrained and args.json_schema is None:
        raise ValueError("--compare-unconstrained needs --json-schema")
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**dataclasses.asdict(engine_args))
    engine = llm.llm_engine
    prefix_len, requests = _sample_requests(args, engine, llm.get_tokenizer())
    schema = args.json_schema
    structured = None if schema is None else StructuredOutputsParams(json=schema)
    params = [
        SamplingParams(
            temperature=1.0,
            ignore_eos=True,
            max_tokens=r.output_len,
            structured_outputs=structured,
        )
        for r in requests
    ]
    prompts = [r.prompt_token_ids for r in requests]
    num_input = sum(len(p) for p in prompts)
    outputs, timed = _timed_runs(llm, prompts, params, args.num_iters_warmup, not args.disable_tqdm)
    elapsed = timed["elapsed_time"]
    result = {
        "model": str(engine_args.model_path),
        "dataset": args.dataset,
        "num_requests": len(requests),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefix_len": prefix_len,
        "json_schema": args.json_schema,
        **timed,
        "total_input_tokens": num_input,
        "requests_per_second": len(requests) / elapsed,
        "input_tokens_per_second": num_input / elapsed,
        "total_tokens_per_second": (num_input + timed["total_output_tokens"]) / elapsed,
        "num_preemptions": engine.get_stats().num_preemptions,
    }
    if structured is not None:
        _report_grammar(engine, result)
    label = "Throughput" if structured is None else "Throughput (JSON schema)"
    _report(label, result, len(requests), num_input)
    if args.compare_unconstrained:
        _compare_unconstrained(llm, prompts, params, outputs, result, args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
