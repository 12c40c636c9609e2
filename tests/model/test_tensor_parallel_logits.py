"""Logits across two real ranks (gloo, one thread each): the distributed greedy argmax against
``torch.argmax`` over the whole row, ties at the shard border included, and the gathered
logits."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from pagedkv.distributed.shard import Shard, vocab_shard
from pagedkv.distributed.tp_group import TPGroup, init_tp_group
from pagedkv.model.config import ModelConfig
from pagedkv.model.cpu_argmax import load_cpu_argmax
from pagedkv.model.parallel_logits import gather_logits, greedy_across_ranks
from pagedkv.model.tensor_parallel import ModelShards
from tests.tiny_models import CONFIGS

T = TypeVar("T")
VOCAB = 7  # rank 0 holds [0, 4), rank 1 [4, 7)
NAN, INF = float("nan"), float("inf")
ROWS = [
    [1, 2, 3, 9, 9, 0, 1],  # a tie across the border: the lower index (rank 0's)
    [1, 2, 3, 4, 5, 9, 9],  # a tie inside rank 1
    [5, 5, 5, 5, 5, 5, 5],  # all equal
    [0, 0, 0, 0, 0, 0, 8],  # the last column
    [-INF, -INF, -INF, -INF, -INF, -INF, 3],
    [1, 2, 3, 4, NAN, 9, 9],  # a NaN wins, as in torch.argmax
    [1, NAN, 3, 4, NAN, 9, 9],
    [-INF] * 7,
]


def on_two_ranks(tmp_path: Path, fn: Callable[[TPGroup], T]) -> list[T]:
    store = str(tmp_path / "store")
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda rank: fn(init_tp_group(rank, 2, store, 30)), range(2)))


def local_vocab(tp: TPGroup) -> Shard:
    """The rank's columns, cut at ``VOCAB`` (as ``ModelShards.vocab``)."""
    shard = vocab_shard(VOCAB, tp.rank, tp.world_size)
    return Shard(shard.start, min(shard.end, VOCAB) - shard.start)


def local_columns(logits: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    vocab = local_vocab(tp)
    return logits[:, vocab.start : vocab.end].contiguous()


@pytest.mark.parametrize("kernel", [None, load_cpu_argmax()], ids=["torch", "compiled"])
def test_greedy_across_ranks_is_torch_argmax(tmp_path: Path, kernel) -> None:
    rows = torch.tensor(ROWS, dtype=torch.float32)
    logits = torch.cat([rows, torch.randn(40, VOCAB, generator=torch.Generator().manual_seed(0))])

    first, other = on_two_ranks(
        tmp_path,
        lambda tp: greedy_across_ranks(local_columns(logits, tp), local_vocab(tp), tp, kernel),
    )
    assert other is None
    assert torch.equal(first, logits.argmax(dim=-1))


def test_gather_logits_is_the_whole_row(tmp_path: Path) -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1))
    first, other = on_two_ranks(
        tmp_path, lambda tp: gather_logits(local_columns(logits, tp), VOCAB, tp)
    )
    assert other is None
    assert torch.equal(first, logits)


def test_model_shards_cut_the_vocabulary_at_its_size() -> None:
    config = ModelConfig.from_hf_config(CONFIGS["llama"]())
    assert ModelShards.of(config, 0, 1).vocab == (0, 256)
    odd = replace(config, vocab_size=VOCAB)
    assert [ModelShards.of(odd, r, 2).vocab for r in range(2)] == [(0, 4), (4, 3)]
