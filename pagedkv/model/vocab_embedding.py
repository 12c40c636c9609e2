"""The token embedding: a row lookup in this rank's rows of the ``[vocab_size, hidden_size]``
weight (vLLM's ``VocabParallelEmbedding``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.distributed.shard import Shard
from pagedkv.distributed.tp_group import SINGLE_RANK, TPGroup


class VocabParallelEmbedding(nn.Module):
    """The rows ``rows`` of the embedding (every row with one rank), without ``nn.Embedding``'s
    random initialisation: the checkpoint fills the weight.

    With several ranks, an id outside this rank's rows embeds to zero and one all-reduce sums
    the ranks' lookups: exactly one rank contributes each token's row, so the sum is that row.

    ``nn.Embedding`` draws its weight with ``normal_``, which on the meta device the loader
    builds models on goes through torch's Python references and imports ``torch._dynamo``: 1.5 s
    of CPU at every process start, for values that are overwritten at once.
    """

    def __init__(self, rows: Shard, embedding_dim: int, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.rows = rows
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(rows.size, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.rows.start
        outside = (local < 0) | (local >= self.rows.size)
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)
        embedded.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(embedded)
