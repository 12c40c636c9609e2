"""Logits across tensor-parallel ranks: each rank's LM head scores its own vocabulary rows
(``ModelShards.vocab``); rank 0 samples.

- ``greedy_across_ranks``: greedy tokens without moving the logits: each rank's per-row
  maximum and its global index, gathered to rank 0, which keeps the largest (a tie goes to the
  lowest rank, whose indices are the lowest: ``torch.argmax``'s first maximum).
- ``gather_logits``: the rows' whole logits on rank 0, for everything else the sampler does.

Both gather host tensors (gloo's gather takes no device tensors; on the CPU the copies are
the tensors themselves) and return rank 0's answer on the logits' device.
"""

from __future__ import annotations

import torch

from pagedkv.distributed.shard import Shard, vocab_shard
from pagedkv.distributed.tp_group import TPGroup
from pagedkv.model.cpu_argmax import CpuArgmax
from pagedkv.model.sampler import argmax


def greedy_across_ranks(
    logits: torch.Tensor, vocab: Shard, tp: TPGroup, argmax_kernel: CpuArgmax | None = None
) -> torch.Tensor | None:
    """``argmax`` of the whole rows whose columns ``vocab`` are this rank's ``logits`` (fp32
    ``[num_rows, vocab.size]``): int64 ``[num_rows]`` on rank 0, None on the others.

    The maximum and its index travel as float64 (exact for any fp32 value and any vocabulary
    under 2**53); a NaN wins as in ``torch.argmax`` (the first one)."""
    local_index = argmax(logits, argmax_kernel)
    local_max = logits.gather(1, local_index.unsqueeze(1)).squeeze(1)
    best = torch.stack([local_max.double(), (local_index + vocab.start).double()])
    gathered = tp.gather(best.cpu())
    if gathered is None:
        return None
    maxima = torch.stack([g[0] for g in gathered])  # [world, num_rows]
    indices = torch.stack([g[1] for g in gathered])
    winner = maxima.argmax(dim=0)
    return indices.gather(0, winner.unsqueeze(0)).squeeze(0).long().to(logits.device)


def gather_logits(logits: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor | None:
    """Every rank's ``logits`` (``[num_rows, its vocabulary rows]``) side by side:
    ``[num_rows, vocab_size]`` on rank 0, None on the others (the input itself with one rank).
    The last rank's shorter share is padded for the gather and cut off after."""
    if tp.world_size == 1:
        return logits
    width = vocab_shard(vocab_size, 0, tp.world_size).size
    padded = logits
    if logits.shape[1] < width:
        padded = logits.new_full((logits.shape[0], width), float("-inf"))
        padded[:, : logits.shape[1]] = logits
    gathered = tp.gather(padded.cpu())
    if gathered is None:
        return None
    return torch.cat(gathered, dim=1)[:, :vocab_size].contiguous().to(logits.device)
