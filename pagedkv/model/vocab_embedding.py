"""The token embedding: a row lookup in a ``[vocab_size, hidden_size]`` weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """``nn.Embedding`` without the random initialisation: the checkpoint fills the weight.

    ``nn.Embedding`` draws its weight with ``normal_``, which on the meta device the loader
    builds models on goes through torch's Python references and imports ``torch._dynamo``: 1.5 s
    of CPU at every process start, for values that are overwritten at once.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
