"""The LM head: the vocabulary projection, with a second weight layout for batches on CPU."""

from __future__ import annotations

import torch

from pagedkv.model.linear import Linear


class LMHead(Linear):
    """``Linear(hidden_size, vocab_size)`` that, in fp32 on CPU, also keeps the checkpoint's
    ``[vocab, hidden]`` layout (``vocab x hidden`` more memory) and multiplies two or more rows
    against it.

    MKL's fp32 products with this head's shape (inner dimension ``hidden``, tens of thousands of
    columns) run fastest against ``[hidden, vocab]`` for one row and against ``[vocab, hidden]``
    for a batch (this project's CPU, 256 x 32000, 2 threads: 1 row 0.9 vs 1.5 ms; 2 rows 1.7 vs
    4.6 ms; 64 rows 9.0 vs 11.0 ms). With the compiled GEMV attached, one row streams the
    ``[vocab, hidden]`` copy through it instead (see ``cpu_gemv``). Call ``prepare`` once the
    weight is loaded.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.register_buffer("weight_by_vocab", None, persistent=False)

    def prepare(self) -> None:
        """Build the ``[vocab, hidden]`` copy when it pays: fp32 on CPU."""
        weight = self.weight
        if weight.device.type == "cpu" and weight.dtype == torch.float32:
            self.weight_by_vocab = weight.t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        by_vocab, gemv = self.weight_by_vocab, self.cpu_gemv
        if by_vocab is not None and gemv is not None and gemv.supports(x):
            return gemv.output_major(x, by_vocab)
        if by_vocab is None or x.shape[0] < 2:
            return torch.mm(x, self.weight)
        return torch.mm(x, self.weight_by_vocab.t())
