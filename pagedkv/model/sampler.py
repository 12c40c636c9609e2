"""Next-token sampling over a batch of logits, with vLLM V1 semantics.

Order of operations: grammar mask (structured outputs) → raw logprobs (if asked) →
penalties → greedy argmax → temperature → min_p → top_k → top_p → one exponential-race draw
per row. Values are validated upstream (``SamplingParams``), not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from pagedkv.model.cpu_argmax import CpuArgmax

SAMPLING_EPS = 1e-5
# top_p first looks for its cut-off among this many most likely tokens, and sorts the whole
# vocabulary only when some row's candidates do not reach p (a sort of 64 x 32000 logits costs
# ~125 ms on one CPU core, this topk a few ms).
_TOP_P_CANDIDATES = 1024
_ARGMAX_CHUNK = 128


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters for ``N`` rows of logits.

    An optional tensor left as None means "off on every row" and skips that step entirely.
    Penalties need ``output_token_ids`` (and ``prompt_token_ids`` for the repetition penalty):
    repetition applies to prompt + output tokens, presence and frequency to output tokens only.
    Rows in ``generators`` draw their noise only from their own generator, so a seeded request
    samples the same tokens whatever else is in the batch.
    """

    temperature: torch.Tensor  # float32 [N]; 0 = greedy
    top_k: torch.Tensor | None = None  # int64 [N]; 0 = off
    top_p: torch.Tensor | None = None  # float32 [N]; 1 = off
    min_p: torch.Tensor | None = None  # float32 [N]; 0 = off
    repetition_penalties: torch.Tensor | None = None  # float32 [N]; 1 = off
    presence_penalties: torch.Tensor | None = None  # float32 [N]; 0 = off
    frequency_penalties: torch.Tensor | None = None  # float32 [N]; 0 = off
    prompt_token_ids: list[Sequence[int]] | None = None
    output_token_ids: list[Sequence[int]] | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> generator
    max_num_logprobs: int | None = None  # top-k logprobs per row; 0 = sampled token's only
    #: Structured outputs: the tokens each row may sample (rows without a grammar: all).
    allowed_token_mask: torch.Tensor | None = None  # bool [N, vocab]
    #: Every row is greedy (as vLLM's ``all_greedy``): temperature, top-k, top-p and min-p and
    #: the generators are then unused. None: derived from ``temperature``.
    all_greedy: bool | None = None

    @property
    def greedy_rows(self) -> torch.Tensor:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalties is not None
            or self.presence_penalties is not None
            or self.frequency_penalties is not None
        )


class LogprobsTensors(NamedTuple):
    """Column 0 is the sampled (or actual prompt) token, then the top ``k`` tokens."""

    token_ids: torch.Tensor  # int64 [N, 1 + k]
    logprobs: torch.Tensor  # float32 [N, 1 + k]
    ranks: torch.Tensor  # int64 [N]: rank of column 0's token, 1 = most likely


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # int64 [N]
    logprobs: LogprobsTensors | None


def argmax(values: torch.Tensor, kernel: CpuArgmax | None = None) -> torch.Tensor:
    """Index of each row's largest value of ``[N, V]`` ``values``: the first of equal ones and
    of NaNs, exactly as ``argmax``, which on CPU is a slow reduction (64 x 32000: 7 ms on one
    core). Contiguous fp32 CPU values go to the compiled ``kernel`` when there is one, others
    to ``chunked_argmax``."""
    if kernel is not None and CpuArgmax.supports(values):
        return kernel(values)
    return chunked_argmax(values)


def chunked_argmax(values: torch.Tensor) -> torch.Tensor:
    """``argmax`` in torch ops: ``amax`` over chunks of 128 columns is vectorised (64 x 32000:
    1 ms on one core); then ``argmax`` runs over the chunk maxima and inside the one chunk that
    holds the first maximum."""
    num_rows, vocab = values.shape
    if vocab < 4 * _ARGMAX_CHUNK:
        return values.argmax(dim=-1)
    num_chunks = vocab // _ARGMAX_CHUNK
    full = num_chunks * _ARGMAX_CHUNK
    maxima = values[:, :full].unflatten(1, (num_chunks, _ARGMAX_CHUNK)).amax(dim=-1)
    if full < vocab:
        maxima = torch.cat((maxima, values[:, full:].amax(dim=-1, keepdim=True)), dim=1)
    start = maxima.argmax(dim=-1) * _ARGMAX_CHUNK
    # The last chunk may be short: its columns past the end repeat the last one, after it.
    columns = (start[:, None] + torch.arange(_ARGMAX_CHUNK, device=values.device)).clamp_(
        max=vocab - 1
    )
    return start + values.gather(1, columns).argmax(dim=-1)


def sample(
    logits: torch.Tensor, metadata: SamplingMetadata, argmax_kernel: CpuArgmax | None = None
) -> SamplerOutput:
    """Sample one token per row of fp32 ``logits [N, vocab]``; ``logits`` is not modified.
    ``argmax_kernel``: the compiled CPU argmax (the model runner's, unless ``--enforce-eager``)."""
    if metadata.allowed_token_mask is not None:
        logits = logits.where(metadata.allowed_token_mask, float("-inf"))
    num_logprobs = metadata.max_num_logprobs
    raw_logprobs = None if num_logprobs is None else torch.log_softmax(logits, dim=-1)
    if metadata.has_penalties:
        logits = apply_penalties(logits, metadata)
    all_greedy = metadata.all_greedy
    if all_greedy is None:
        all_greedy = bool(metadata.greedy_rows.all())
    if all_greedy:
        sampled = argmax(logits, argmax_kernel)
    else:
        greedy_rows = metadata.greedy_rows
        sampled = _sample_random(logits, metadata, greedy_rows, argmax_kernel)
        if bool(greedy_rows.any()):
            sampled = torch.where(greedy_rows, argmax(logits, argmax_kernel), sampled)
    if raw_logprobs is None:
        return SamplerOutput(sampled, None)
    return SamplerOutput(sampled, gather_logprobs(raw_logprobs, sampled, num_logprobs))


def _sample_random(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    greedy_rows: torch.Tensor,
    argmax_kernel: CpuArgmax | None,
) -> torch.Tensor:
    temperature = torch.where(greedy_rows, 1.0, metadata.temperature)
    logits = logits / temperature.unsqueeze(1)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    if metadata.top_k is not None:
        logits = apply_top_k(logits, metadata.top_k)
    if metadata.top_p is not None:
        logits = apply_top_p(logits, metadata.top_p)
    probs = logits.softmax(dim=-1)
    # argmax(p / q) with q ~ Exp(1) i.i.d. draws index i with probability p_i. q = -log(u) with
    # u ~ U[0, 1): on CPU, uniform_ + log is several times faster than exponential_.
    uniform = torch.empty_like(probs)
    if len(metadata.generators) < probs.shape[0]:
        uniform.uniform_()
    for row, generator in metadata.generators.items():
        uniform[row].uniform_(generator=generator)
    return argmax(probs.div_(uniform.log_().neg_()), argmax_kernel)


def _token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """``counts[i, t]`` = occurrences of token ``t`` in ``token_ids[i]``, as float32."""
    width = max((len(ids) for ids in token_ids), default=0)
    padded = np.full((len(token_ids), width), vocab_size, dtype=np.int64)
    for row, ids in enumerate(token_ids):
        padded[row, : len(ids)] = ids
    counts = torch.zeros(len(token_ids), vocab_size + 1)
    counts.scatter_add_(1, torch.from_numpy(padded), torch.ones(padded.shape))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition divides positive / multiplies negative logits of every prompt or output token;
    then ``logit -= frequency * count_in_output + presence * (count_in_output > 0)``."""
    num_rows, vocab_size = logits.shape
    output_ids = metadata.output_token_ids or [[] for _ in range(num_rows)]
    output_counts = _token_counts(output_ids, vocab_size).to(logits.device)
    if metadata.repetition_penalties is not None:
        seen = output_counts > 0
        if metadata.prompt_token_ids is not None:
            seen |= _token_counts(metadata.prompt_token_ids, vocab_size).to(logits.device) > 0
        penalty = metadata.repetition_penalties.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if metadata.frequency_penalties is not None:
        logits = logits - metadata.frequency_penalties.unsqueeze(1) * output_counts
    if metadata.presence_penalties is not None:
        logits = logits - metadata.presence_penalties.unsqueeze(1) * (output_counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p * max_probability`` of their row."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``k`` highest logits (ties at the k-th value are kept); ``k = 0`` is off.

    One ``topk`` of the largest ``k`` in the batch instead of sorting the vocabulary.
    """
    top_k = top_k.clamp(max=logits.shape[-1])
    max_k = int(top_k.max())
    if max_k <= 0:
        return logits
    top_values = logits.topk(max_k, dim=-1).values
    kth_value = top_values.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))
    kth_value.masked_fill_((top_k <= 0).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth_value, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``p``: a token stays
    when the tokens ranked above it hold less than ``p``, so the most likely one always stays.
    Rows with ``p >= 1`` are left alone.

    The cut-off is searched among the ``_TOP_P_CANDIDATES`` most likely tokens. When those reach
    ``p``, every other token is ranked below at least ``p`` and is dropped, exactly as a full
    sort would drop it; otherwise the vocabulary is sorted.
    """
    probs = logits.softmax(dim=-1)
    inactive = (top_p >= 1).unsqueeze(1)
    num_candidates = min(_TOP_P_CANDIDATES, probs.shape[-1])
    sorted_probs, sorted_ids = probs.topk(num_candidates, dim=-1)
    short = ~inactive.squeeze(1) & (sorted_probs.sum(dim=-1) < top_p)
    if num_candidates < probs.shape[-1] and bool(short.any()):
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_above < top_p.unsqueeze(1)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, sorted_ids, keep_sorted)
    return logits.masked_fill(~(keep | inactive), float("-inf"))


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprob and rank of ``token_ids[i]`` in row ``i``, plus the row's top ``num_logprobs``."""
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    ids, values = token_ids.unsqueeze(1), token_logprobs
    if num_logprobs > 0:
        top_values, top_ids = logprobs.topk(num_logprobs, dim=-1)
        ids, values = torch.cat((ids, top_ids), dim=1), torch.cat((values, top_values), dim=1)
    return LogprobsTensors(ids, values, ranks)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Prompt logprobs: row ``j`` of ``logits`` is the model's output at prompt position ``j``,
    ``next_token_ids[j]`` the prompt token at position ``j + 1`` (so a prompt of ``n`` tokens
    gives ``n - 1`` rows). Raw log-softmax, as for sampled tokens."""
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), next_token_ids, num_logprobs)
