"""Seeded synthetic workloads as token ids, so every prompt has exactly the length asked for.

random:        [ input_len random tokens ]
shared-prefix: [ prefix_len tokens, the same for all | input_len random tokens ]
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import NamedTuple

from pagedkv.arg_types import positive_int

DATASETS = ("random", "shared-prefix")


class BenchRequest(NamedTuple):
    prompt_token_ids: list[int]
    output_len: int


def add_dataset_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="random", help="(default: random)")
    g.add_argument("--num-prompts", type=positive_int, default=64, help="requests (default: 64)")
    g.add_argument(
        "--input-len",
        type=positive_int,
        default=64,
        help="random tokens per prompt (default: 64)",
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
        default=64,
        help="shared-prefix only: tokens every prompt starts with (default: 64)",
    )
    return g


class RequestSampler:
    """Request ``index`` of a seeded synthetic workload, drawn on demand: the same seed and index
    give the same prompt whatever was drawn before, so a run of any length gets a fresh prompt
    per request (``bench serve --duration``). Prompts are drawn uniformly from the vocabulary
    minus ``exclude_token_ids`` (e.g. special tokens); ``prefix_len`` is used by the
    shared-prefix dataset only, whose prompts all start with the same prefix."""

    def __init__(
        self,
        dataset: str,
        input_len: int,
        output_len: int,
        vocab_size: int,
        seed: int,
        prefix_len: int = 0,
        exclude_token_ids: Collection[int] = (),
    ) -> None:
        if dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
        if input_len < 1:
            raise ValueError(f"input_len must be >= 1, got {input_len}")
        if output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {output_len}")
        if dataset == "shared-prefix" and prefix_len < 1:
            raise ValueError(
                f"prefix_len must be >= 1 for the shared-prefix dataset, got {prefix_len}"
            )
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        import numpy as np  # here, not at the top: `bench serve --help` imports this module

        excluded = set(exclude_token_ids)
        self._vocab = np.array([t for t in range(vocab_size) if t not in excluded])
        shared = dataset == "shared-prefix"
        self._prefix = (
            np.random.default_rng(seed).choice(self._vocab, prefix_len).tolist() if shared else []
        )
        self.input_len, self.output_len, self.seed = input_len, output_len, seed

    def __getitem__(self, index: int) -> BenchRequest:
        if index < 0:
            raise IndexError(f"request index must be >= 0, got {index}")
        import numpy as np

        rng = np.random.default_rng((self.seed, index))
        suffix = rng.choice(self._vocab, self.input_len).tolist()
        return BenchRequest(self._prefix + suffix, self.output_len)

    def first(self, num_prompts: int) -> list[BenchRequest]:
        """Requests ``0 .. num_prompts - 1``."""
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        return [self[index] for index in range(num_prompts)]
