from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.model.cpu_argmax import load_cpu_argmax
from pagedkv.model.sampler import (
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    argmax,
    chunked_argmax,
    compute_prompt_logprobs,
    sample,
)

VOCAB = 50
CPU_ARGMAX = load_cpu_argmax()
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
INF = float("inf")


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def full(num_rows: int, value: float) -> torch.Tensor:
    return torch.full((num_rows,), value)


def sampled_set(metadata_kwargs: dict[str, object], num_rows: int = 4000) -> torch.Tensor:
    """Sample ``num_rows`` times from PROBS with the given filters; return per-token counts."""
    logits = PROBS.log().expand(num_rows, -1).contiguous()
    metadata = SamplingMetadata(temperature=full(num_rows, 1.0), **metadata_kwargs)
    torch.manual_seed(0)
    return torch.bincount(sample(logits, metadata).sampled_token_ids, minlength=len(PROBS))


def test_greedy_is_exact_argmax() -> None:
    logits = random_logits(16)
    out = sample(logits, SamplingMetadata(temperature=full(16, 0.0)))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.sampled_from([1, 511, 512, 513, 1000, 32000]),
    num_rows=st.integers(1, 5),
    levels=st.integers(1, 4),
    specials=st.lists(st.sampled_from([INF, -INF, float("nan")]), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_argmax_equals_torch_argmax(vocab, num_rows, levels, specials, seed) -> None:
    """Few distinct values make ties everywhere: the first maximum (or NaN) must win, in any
    chunk or block, the short last one included, in the compiled kernel (``argmax`` of fp32 CPU
    values) and in the torch fallback (``chunked_argmax``)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, levels, (num_rows, vocab), generator=gen).float()
    for special in specials:
        row, col = (int(torch.randint(0, n, (1,), generator=gen)) for n in (num_rows, vocab))
        values[row, col] = special
    expected = values.argmax(dim=-1)
    assert torch.equal(argmax(values, CPU_ARGMAX), expected)
    assert torch.equal(chunked_argmax(values), expected)


def test_argmax_of_rows_of_minus_infinity_and_of_a_strided_view() -> None:
    values = torch.full((3, 700), -INF)
    values[1, 650] = -1e30
    assert argmax(values, CPU_ARGMAX).tolist() == [0, 650, 0]
    wide = torch.randn(4, 1400)
    assert torch.equal(argmax(wide[:, ::2], CPU_ARGMAX), wide[:, ::2].argmax(dim=-1))


def test_all_greedy_metadata_takes_the_argmax_whatever_the_temperature_says() -> None:
    """``all_greedy`` comes from the request parameters; the tensor is not consulted."""
    logits = random_logits(6)
    out = sample(logits, SamplingMetadata(temperature=full(6, 0.7), all_greedy=True))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = random_logits(8)
    temperature = torch.tensor([0.0, 1.5, 0.0, 0.7, 0.0, 2.0, 0.0, 1.0])
    for seed in range(5):
        torch.manual_seed(seed)
        sampled = sample(logits, SamplingMetadata(temperature=temperature)).sampled_token_ids
        greedy = temperature == 0
        assert torch.equal(sampled[greedy], logits.argmax(-1)[greedy])


def test_top_k_one_is_argmax() -> None:
    logits = random_logits(32)
    metadata = SamplingMetadata(temperature=full(32, 1.3), top_k=torch.ones(32, dtype=torch.int64))
    for seed in range(5):
        torch.manual_seed(seed)
        assert torch.equal(sample(logits, metadata).sampled_token_ids, logits.argmax(-1))


def test_unfiltered_sampling_follows_the_distribution() -> None:
    counts = sampled_set({}, num_rows=20000)
    torch.testing.assert_close(counts / counts.sum(), PROBS, atol=0.015, rtol=0)


def test_temperature_sharpens() -> None:
    logits = PROBS.log().expand(20000, -1).contiguous()
    torch.manual_seed(0)
    sampled = sample(logits, SamplingMetadata(temperature=full(20000, 0.5))).sampled_token_ids
    expected = PROBS**2 / (PROBS**2).sum()
    freq = torch.bincount(sampled, minlength=4) / 20000
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({"top_k": full(4000, 2).long()}, [0, 1]),
        ({"top_p": full(4000, 0.7)}, [0, 1]),  # 0.5 < 0.7 <= 0.5 + 0.3
        ({"top_p": full(4000, 0.85)}, [0, 1, 2]),
        ({"min_p": full(4000, 0.5)}, [0, 1]),  # threshold 0.25
        ({"min_p": full(4000, 0.2)}, [0, 1, 2]),  # threshold 0.1
        ({"top_k": full(4000, 3).long(), "top_p": full(4000, 0.6)}, [0, 1]),
        ({"top_k": full(4000, 0).long(), "top_p": full(4000, 1.0)}, [0, 1, 2, 3]),
    ],
)
def test_filters_keep_exactly_the_allowed_tokens(
    kwargs: dict[str, object], allowed: list[int]
) -> None:
    counts = sampled_set(kwargs)
    assert counts.nonzero().flatten().tolist() == allowed


def test_filter_masks_per_row() -> None:
    logits = PROBS.log().expand(3, -1).contiguous()
    masked = apply_top_k(logits, torch.tensor([1, 0, 3]))
    assert masked.isfinite().tolist() == [
        [True, False, False, False],
        [True, True, True, True],
        [True, True, True, False],
    ]
    masked = apply_top_p(logits, torch.tensor([0.4, 0.75, 1.0]))
    assert masked.isfinite().sum(-1).tolist() == [1, 2, 4]
    torch.testing.assert_close(masked[2], logits[2])
    masked = apply_min_p(logits, torch.tensor([0.0, 0.5, 0.9]))
    assert masked.isfinite().sum(-1).tolist() == [4, 2, 1]


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    def draws(batch_rows: int, row: int, seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        tokens = []
        for step in range(12):
            logits = random_logits(batch_rows, seed=100 + step)
            logits[row] = random_logits(1, seed=step)[0]
            temperature = torch.linspace(0.5, 1.5, batch_rows)
            temperature[row] = 1.0
            metadata = SamplingMetadata(temperature=temperature, generators={row: generator})
            tokens.append(int(sample(logits, metadata).sampled_token_ids[row]))
        return tokens

    alone = draws(1, 0, seed=7)
    assert draws(5, 3, seed=7) == alone
    assert draws(9, 0, seed=7) == alone
    assert draws(5, 3, seed=8) != alone


def test_penalties_match_hand_computed_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    metadata = SamplingMetadata(
        temperature=full(2, 0.0),
        repetition_penalties=torch.tensor([2.0, 1.0]),
        presence_penalties=torch.tensor([0.5, 0.25]),
        frequency_penalties=torch.tensor([0.1, 1.0]),
        prompt_token_ids=[[1, 1], [4]],
        output_token_ids=[[0, 0, 3], [2, 2, 2]],
    )
    penalized = apply_penalties(logits, metadata)
    expected = torch.tensor(
        [
            # row 0: repetition on {0, 1, 3} (prompt 1; output 0 twice and 3 once)
            [2.0 / 2 - 0.1 * 2 - 0.5, -1.0 * 2, 0.5, -3.0 * 2 - 0.1 - 0.5, 1.0],
            # row 1: prompt tokens get no presence/frequency penalty
            [1.0, 1.0, 1.0 - 1.0 * 3 - 0.25, 1.0, 1.0],
        ]
    )
    torch.testing.assert_close(penalized, expected)
    assert torch.equal(sample(logits, metadata).sampled_token_ids, expected.argmax(-1))


def test_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(6)
    metadata = SamplingMetadata(
        temperature=torch.tensor([0.0, 0.8, 1.0, 0.0, 2.0, 0.5]),
        top_k=torch.tensor([0, 5, 0, 0, 2, 0]),
        frequency_penalties=full(6, 0.5),
        output_token_ids=[[1, 2], [3], [], [4, 4], [0], [7]],
        max_num_logprobs=3,
    )
    out = sample(logits, metadata)
    assert out.logprobs is not None
    raw = torch.log_softmax(logits, -1)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprobs.token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top = raw.topk(3, dim=-1)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs.logprobs[:, 1:], top.values)
    expected_ranks = (raw > raw.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(out.logprobs.ranks, expected_ranks)


def test_zero_logprobs_returns_only_the_sampled_token() -> None:
    out = sample(random_logits(3), SamplingMetadata(temperature=full(3, 0.0), max_num_logprobs=0))
    assert out.logprobs is not None
    assert out.logprobs.token_ids.shape == (3, 1)
    assert out.logprobs.ranks.tolist() == [1, 1, 1]


def test_prompt_logprobs() -> None:
    logits = random_logits(4)
    next_tokens = torch.tensor([3, 0, 49, 7])
    result = compute_prompt_logprobs(logits, next_tokens, 2)
    raw = torch.log_softmax(logits, -1)
    assert result.token_ids[:, 0].tolist() == next_tokens.tolist()
    torch.testing.assert_close(result.logprobs[:, 0], raw[torch.arange(4), next_tokens])
    torch.testing.assert_close(result.logprobs[:, 1:], raw.topk(2, dim=-1).values)
    expected_ranks = (raw > raw[torch.arange(4), next_tokens][:, None]).sum(-1) + 1
    assert torch.equal(result.ranks, expected_ranks)


def vllm_top_p_reference(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """vLLM's formulation: sort ascending, drop the prefix whose cumulative mass is <= 1 - p."""
    sorted_logits, order = logits.sort(dim=-1)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    dropped = cumulative <= 1 - top_p.unsqueeze(1)
    dropped[:, -1] = False
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(dropped, -INF))


@pytest.mark.parametrize("scales", [(4.0, 6.0), (0.05, 6.0)], ids=["candidates", "full-sort"])
def test_top_p_on_a_large_vocabulary_matches_a_full_sort(scales: tuple[float, float]) -> None:
    gen = torch.Generator().manual_seed(3)
    num_rows = 12
    # Peaked rows reach p within the top candidates; flat ones force the full sort.
    scale = torch.linspace(*scales, num_rows).unsqueeze(1)
    logits = torch.randn(num_rows, 5000, generator=gen) * scale
    top_p = torch.rand(num_rows, generator=gen) * 0.9 + 0.05
    top_p[::5] = 1.0
    masked = apply_top_p(logits, top_p)
    assert torch.equal(masked.isfinite(), vllm_top_p_reference(logits, top_p).isfinite())
    assert masked[::5].isfinite().all()


def _pack(allowed: np.ndarray) -> np.ndarray:
    """Bool ``[rows, vocab]`` -> packed int32 words, bit ``t % 32`` of word ``t // 32``."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, -(-vocab // 32) * 32), dtype=bool)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


def test_grammar_bitmask_unpacks_to_the_allowed_tokens() -> None:
    """The engine's packed bitmask (llguidance's layout) and the mask the sampler applies agree,
    word boundaries and a vocabulary wider than the bitmask included."""
    from pagedkv.worker.scheduler_output import GrammarBitmask

    allowed = np.random.default_rng(0).random((3, 70)) < 0.3
    allowed[:, 31:33] = True
    bitmask = GrammarBitmask(["a", "b", "c"], _pack(allowed))
    assert np.array_equal(bitmask.allowed(70), allowed)
    wider = bitmask.allowed(100)  # the model pads its vocabulary past the tokenizer's 96
    assert np.array_equal(wider[:, :70], allowed) and not wider[:, 70:].any()


def test_allowed_token_mask_constrains_only_its_rows() -> None:
    """Rows 1 and 3 are under a grammar; rows 0 and 2 sample as without it. Masked tokens are
    never sampled, greedy picks the best allowed token, and logprobs are the masked ones (vLLM
    applies the mask before its sampler)."""
    num_rows = 4
    logits = random_logits(num_rows, seed=3)
    mask = torch.ones(num_rows, VOCAB, dtype=torch.bool)
    mask[[1, 3]] = torch.rand(2, VOCAB, generator=torch.Generator().manual_seed(1)) < 0.2
    mask[[1, 3], 31:33] = True
    temperature = torch.tensor([0.0, 0.0, 1.0, 1.0])
    metadata = SamplingMetadata(temperature, allowed_token_mask=mask, max_num_logprobs=0)
    free = sample(logits, SamplingMetadata(temperature=temperature))
    for seed in range(20):
        torch.manual_seed(seed)
        out = sample(logits, metadata)
        assert mask[torch.arange(num_rows), out.sampled_token_ids].all()
        assert out.logprobs.logprobs[:, 0].isfinite().all()
    best_allowed = logits[1].masked_fill(~mask[1], -INF).argmax()
    assert out.sampled_token_ids[1] == best_allowed
    assert out.sampled_token_ids[0] == free.sampled_token_ids[0]
    raw = torch.log_softmax(logits[1].masked_fill(~mask[1], -INF), -1)
    assert out.logprobs.logprobs[1, 0] == pytest.approx(raw[best_allowed].item())
    assert torch.equal(logits, random_logits(num_rows, seed=3))  # not modified in place
