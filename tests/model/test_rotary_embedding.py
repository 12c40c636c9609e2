"""The rotary tables: looked up per step, equal bit for bit to computing each position alone."""

from __future__ import annotations

import torch

from pagedkv.model.config import RopeConfig
from pagedkv.model.rotary_embedding import RotaryEmbedding, compute_inv_freq

ROPE = RopeConfig(rope_type="default", rope_theta=10000.0)


def _direct(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables for ``positions`` alone, as transformers computes them."""
    freqs = positions[:, None].float() * compute_inv_freq(ROPE, head_dim)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def test_looked_up_rows_equal_each_position_computed_alone() -> None:
    rope = RotaryEmbedding(32, ROPE)
    for start in range(0, 5000, 97):
        positions = torch.arange(start, start + 3)
        cos, signed_sin = rope(positions, torch.float32)
        want_cos, want_sin = _direct(positions, 32)
        assert cos.shape == (3, 1, 32)
        assert torch.equal(cos[:, 0], want_cos) and torch.equal(signed_sin[:, 0], want_sin)


def test_tables_grow_to_the_next_power_of_two_and_keep_their_rows() -> None:
    rope = RotaryEmbedding(16, ROPE)
    rope(torch.tensor([3]), torch.float32)
    assert rope.cos_cache.shape == (256, 16)
    before = rope.cos_cache.clone()
    cos, _ = rope(torch.tensor([1000, 2]), torch.float32)
    assert rope.cos_cache.shape == (1024, 16)
    assert torch.equal(rope.cos_cache[:256], before)
    assert torch.equal(cos[:, 0], _direct(torch.tensor([1000, 2]), 16)[0])


def test_tables_follow_the_dtype_asked_for() -> None:
    rope = RotaryEmbedding(16, ROPE)
    cos, signed_sin = rope(torch.tensor([5, 9]), torch.bfloat16)
    want_cos, want_sin = _direct(torch.tensor([5, 9]), 16)
    assert cos.dtype == torch.bfloat16
    assert torch.equal(cos[:, 0], want_cos.bfloat16())
    assert torch.equal(signed_sin[:, 0], want_sin.bfloat16())
    assert rope(torch.tensor([5]), torch.float32)[0].dtype == torch.float32
