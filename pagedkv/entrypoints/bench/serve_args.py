"""``pagedkv bench serve`` flags (kept apart from the load generator so ``--help`` imports
nothing heavy)."""

from __future__ import annotations

import argparse
import math

from pagedkv.arg_types import positive_float, positive_int
from pagedkv.entrypoints.bench.datasets import add_dataset_args


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument(
        "--base-url",
        nargs="+",
        default=["http://127.0.0.1:8000"],
        help="server URL; several share the requests in turn (default: %(default)s)",
    )
    g.add_argument("--model", default=None, help="model name (default: the server's first)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument(
        "--timeout", type=positive_float, default=600.0, help="seconds per request (default: 600)"
    )
    add_dataset_args(parser)
    g = parser.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=positive_float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default: inf = all at once)",
    )
    g.add_argument(
        "--max-concurrency", type=positive_int, default=None, help="most requests in flight"
    )
    g.add_argument(
        "--duration",
        type=positive_float,
        default=None,
        metavar="S",
        help="run --max-concurrency clients back to back for S seconds, each request with a "
        "fresh prompt, instead of sending --num-prompts requests once",
    )
    g = parser.add_argument_group("checks")
    g.add_argument(
        "--check-metrics",
        nargs="+",
        default=None,
        metavar="URL",
        help="afterwards, each of these instances must show no running or waiting request and "
        "zero KV cache usage in /metrics (exit 1 otherwise)",
    )
    g.add_argument(
        "--settle-timeout",
        type=float,
        default=30.0,
        help="seconds the instances get to come back to rest (default: %(default)s)",
    )
    g.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals (default: 0)")
    g.add_argument(
        "--vocab-size",
        type=positive_int,
        default=256,
        help="prompt token ids are drawn below this (default: 256, valid for byte-level BPE)",
    )
    g = parser.add_argument_group("output")
    g.add_argument("--result-json", default=None, metavar="PATH", help="write results as JSON")
    g.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of the latencies")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
