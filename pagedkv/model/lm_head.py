"""The LM head: the vocabulary projection, with a second weight layout on CPU."""

from __future__ import annotations

import torch

from pagedkv.model.cpu_onednn import packed_matmul
from pagedkv.model.linear import Linear
from pagedkv.model.tuning import TUNE_ROWS, KernelChoices

#: At most this many weights take part in the timing (64 MB of fp32): enough that they stream
#: from memory as the whole head does, bounded for large vocabularies.
TUNE_MAX_WEIGHTS = 1 << 24
_LAYOUTS = {True: "[vocab, hidden]", False: "[hidden, vocab]"}


class LMHead(Linear):
    """``Linear(hidden_size, vocab_size)`` that, in fp32 on CPU, may also keep the checkpoint's
    ``[vocab, hidden]`` layout (``vocab x hidden`` more memory), where it pays.

    - One row: the compiled GEMV (``cpu_gemv``) against whichever layout
      ``choose_gemv_layout`` timed faster; without it, MKL against ``[hidden, vocab]``.
    - Batches: oneDNN's packed copy where ``cpu_onednn`` chose it, else MKL against whichever
      layout ``choose_batch_layout`` timed faster on this machine. The answer depends on the CPU:
      256 x 32000, 2 threads, ``[vocab, hidden]`` vs ``[hidden, vocab]``: an Intel Xeon 1.7 vs
      4.6 ms at 2 rows and 9.0 vs 11.0 ms at 64; an AMD EPYC (Zen 4) 11.1 vs 3.5 ms at 2 rows
      and 17.4 vs 14.2 ms at 64.

    Call ``prepare`` once the weight is loaded, ``choose_batch_layout`` before the first batch,
    and ``release_unused_copy`` once the kernels are attached. The choices are timed once per
    machine (``tuning.KernelChoices``): the two layouts round alike only up to fp32.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.register_buffer("weight_by_vocab", None, persistent=False)
        #: Batches multiply against ``weight_by_vocab`` (set by ``choose_batch_layout``).
        self.batches_by_vocab = False
        #: The one-row GEMV reads ``weight_by_vocab`` (set by ``choose_gemv_layout``).
        self.gemv_by_vocab = True

    def prepare(self) -> None:
        """Build the ``[vocab, hidden]`` copy (fp32 on CPU)."""
        weight = self.weight
        if weight.device.type == "cpu" and weight.dtype == torch.float32:
            self.weight_by_vocab = weight.t().contiguous()

    def choose_batch_layout(self, choices: KernelChoices, repeats: int = 3) -> None:
        """Which layout MKL multiplies batches against: one ``TUNE_ROWS`` batch against each
        (0.1 s at startup here, where ``choices`` has no answer yet)."""
        if self.weight_by_vocab is None:
            return
        hidden, vocab = self.weight.shape
        columns = min(vocab, max(1, TUNE_MAX_WEIGHTS // hidden))
        x = torch.full((TUNE_ROWS, hidden), 0.5)
        by_hidden, by_vocab = self.weight[:, :columns], self.weight_by_vocab[:columns].t()
        self.batches_by_vocab = choices.first_is_faster(
            f"LM head batches by vocab over by hidden: {hidden}x{vocab}",
            lambda: torch.mm(x, by_vocab),
            lambda: torch.mm(x, by_hidden),
            repeats,
        )

    def choose_gemv_layout(self, choices: KernelChoices, repeats: int = 5) -> None:
        """Which layout the attached GEMV reads for one row: one row against each (where
        ``choices`` has no answer yet). On a Zen 5 EPYC the two are equal inside the engine
        (1.40 vs 1.38 ms per token), so the copy can go; elsewhere it was the faster one."""
        gemv, by_vocab = self.cpu_gemv, self.weight_by_vocab
        if gemv is None or by_vocab is None:
            return
        hidden, vocab = self.weight.shape
        x = torch.full((1, hidden), 0.5)
        self.gemv_by_vocab = choices.first_is_faster(
            f"LM head one row by vocab over by hidden: {hidden}x{vocab}",
            lambda: gemv.output_major(x, by_vocab),
            lambda: gemv.input_major(x, self.weight, None),
            repeats,
        )

    def release_unused_copy(self) -> None:
        """Free the ``[vocab, hidden]`` copy when nothing reads it: one rows go elsewhere (no
        GEMV, or the GEMV timed no slower against ``[hidden, vocab]``) and so do batches
        (oneDNN's packed copy, or MKL timed faster against ``[hidden, vocab]``)."""
        rows_read_it = self.cpu_gemv is not None and self.gemv_by_vocab
        batches_read_it = self.weight_packed is None and self.batches_by_vocab
        if not rows_read_it and not batches_read_it:
            self.weight_by_vocab = None

    def describe_layouts(self) -> str:
        """What one rows and batches multiply against, for the start-up log."""
        by_vocab = self.weight_by_vocab is not None
        batches = f"MKL {_LAYOUTS[by_vocab and self.batches_by_vocab]}"
        if self.weight_packed is not None:
            batches = "oneDNN"
        one_row = "MKL [hidden, vocab]" if self.weight_packed is None else "oneDNN"
        if self.cpu_gemv is not None:
            one_row = f"GEMV {_LAYOUTS[by_vocab and self.gemv_by_vocab]}"
        return f"one row {one_row}, batches {batches}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        by_vocab, gemv = self.weight_by_vocab, self.cpu_gemv
        if gemv is not None and gemv.supports(x):
            if by_vocab is not None and self.gemv_by_vocab:
                return gemv.output_major(x, by_vocab)
            return gemv.input_major(x, self.weight, None)
        if self.weight_packed is not None:
            return packed_matmul(x, self.weight_packed, None)
        if by_vocab is None or x.shape[0] < 2 or not self.batches_by_vocab:
            return torch.mm(x, self.weight)
        return torch.mm(x, by_vocab.t())
