"""Seeded synthetic workloads as token ids, so every prompt has exactly the length asked for.

random:        [ input_len random tokens ]
shared-prefix: [ prefix_len tokens, the same for all | input_len random tokens ]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Collection
from typing import NamedTuple

import numpy as np

DATASETS = ("random", "shared-prefix")


class BenchRequest(NamedTuple):
    prompt_token_ids: list[int]
    output_len: int


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a count of 0 would make a run that does nothing or hangs)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (inf allowed, NaN not)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def add_dataset_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="random", help="(default: random)")
    g.add_argument("--num-prompts", type=positive_int, default=64, help="requests (default: 64)")
    g.add_argument(
        "--input-len",
        type=positive_int,
        default=128,
        help="random tokens per prompt (default: 128)",
    )
    g.add_argument(
        "--output-len",
        type=positive_int,
        default=128,
        help="tokens generated per prompt (default: 128)",
    )
    g.add_argument(
        "--prefix-len",
        type=int,
        default=256,
        help="shared-prefix only: tokens every prompt starts with (default: 256)",
    )
    return g


def sample_requests(
    dataset: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
    prefix_len: int = 0,
    exclude_token_ids: Collection[int] = (),
) -> list[BenchRequest]:
    """Prompts drawn uniformly from the vocabulary minus ``exclude_token_ids`` (e.g. special
    tokens). ``prefix_len`` is used by the shared-prefix dataset only."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    for name, value in (("num_prompts", num_prompts), ("input_len", input_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    if dataset == "shared-prefix" and prefix_len < 1:
        raise ValueError(f"prefix_len must be >= 1 for the shared-prefix dataset, got {prefix_len}")
    excluded = set(exclude_token_ids)
    vocab = np.array([t for t in range(vocab_size) if t not in excluded])
    rng = np.random.default_rng(seed)
    prefix = rng.choice(vocab, prefix_len).tolist() if dataset == "shared-prefix" else []
    return [
        BenchRequest(prefix + rng.choice(vocab, input_len).tolist(), output_len)
        for _ in range(num_prompts)
    ]
