"""The LM head: the vocabulary projection, with a second weight layout on CPU."""

from __future__ import annotations

import statistics
import time

import torch

from pagedkv.model.cpu_onednn import packed_matmul
from pagedkv.model.linear import Linear

#: Rows of the batch the two layouts are timed with (a mid-size decode batch).
TUNE_ROWS = 32
#: At most this many weights take part in the timing (64 MB of fp32): enough that they stream
#: from memory as the whole head does, bounded for large vocabularies.
TUNE_MAX_WEIGHTS = 1 << 24


class LMHead(Linear):
    """``Linear(hidden_size, vocab_size)`` that, in fp32 on CPU, also keeps the checkpoint's
    ``[vocab, hidden]`` layout (``vocab x hidden`` more memory).

    - One row: the compiled GEMV streams the ``[vocab, hidden]`` copy (``cpu_gemv``); without
      it, MKL against ``[hidden, vocab]``.
    - Batches: MKL against whichever layout ``prepare`` timed faster on this machine. The
      answer depends on the CPU: 256 x 32000, 2 threads, ``[vocab, hidden]`` vs
      ``[hidden, vocab]``: an Intel Xeon 1.7 vs 4.6 ms at 2 rows and 9.0 vs 11.0 ms at 64; an
      AMD EPYC (Zen 4) 11.1 vs 3.5 ms at 2 rows and 17.4 vs 14.2 ms at 64.

    Call ``prepare`` once the weight is loaded.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.register_buffer("weight_by_vocab", None, persistent=False)
        #: Batches multiply against ``weight_by_vocab`` (set by ``prepare``).
        self.batches_by_vocab = False

    def prepare(self) -> None:
        """Build the ``[vocab, hidden]`` copy (fp32 on CPU) and time which layout batches take."""
        weight = self.weight
        if weight.device.type == "cpu" and weight.dtype == torch.float32:
            self.weight_by_vocab = weight.t().contiguous()
            self.batches_by_vocab = self._vocab_major_is_faster()

    def release_unused_copy(self) -> None:
        """Free the ``[vocab, hidden]`` copy when nothing reads it: no one-row GEMV attached
        and batches faster against ``[hidden, vocab]`` (``--enforce-eager`` on such a CPU)."""
        if self.cpu_gemv is None and not self.batches_by_vocab:
            self.weight_by_vocab = None

    def _vocab_major_is_faster(self, repeats: int = 3) -> bool:
        """One ``TUNE_ROWS`` batch against each layout, alternately, ``repeats`` times after a
        warm-up: whether ``[vocab, hidden]`` has the smaller median (0.1 s at startup here)."""
        hidden, vocab = self.weight.shape
        columns = min(vocab, max(1, TUNE_MAX_WEIGHTS // hidden))
        x = torch.full((TUNE_ROWS, hidden), 0.5)
        layouts = {False: self.weight[:, :columns], True: self.weight_by_vocab[:columns].t()}
        times: dict[bool, list[float]] = {False: [], True: []}
        with torch.no_grad():
            for attempt in range(repeats + 1):
                for by_vocab, weight in layouts.items():
                    start = time.perf_counter()
                    torch.mm(x, weight)
                    if attempt:  # the first round warms up
                        times[by_vocab].append(time.perf_counter() - start)
        return statistics.median(times[True]) < statistics.median(times[False])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        by_vocab, gemv = self.weight_by_vocab, self.cpu_gemv
        if by_vocab is not None and gemv is not None and gemv.supports(x):
            return gemv.output_major(x, by_vocab)
        if self.weight_packed is not None:
            return packed_matmul(x, self.weight_packed, None)
        if by_vocab is None or x.shape[0] < 2 or not self.batches_by_vocab:
            return torch.mm(x, self.weight)
        return torch.mm(x, by_vocab.t())
