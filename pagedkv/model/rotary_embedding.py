"""Rotary position embedding (the half-split "neox" layout Llama-family checkpoints use)."""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedkv.model.config import RopeConfig


def compute_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies, fp32, computed with the same operations as transformers so they match
    bit for bit (``transformers.modeling_rope_utils``)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.rope_theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # llama3: leave high frequencies, divide low ones by `factor`, interpolate in between.
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / rope.factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """Computes, once per forward, the tables every layer applies with ``apply_rotary_emb``."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        # Built on the CPU explicitly, so it is real even when the layers are built on "meta".
        self.register_buffer("inv_freq", compute_inv_freq(rope, head_dim), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, signed_sin)``, each ``[num_tokens, 1, head_dim]``.

        ``signed_sin = cat(-sin, sin)`` so that rotating half the head is one ``roll``.
        """
        freqs = positions[:, None].float() * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1)
        signed_sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype).unsqueeze(1), signed_sin.to(dtype).unsqueeze(1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, on
    ``[num_tokens, num_heads, head_dim]``."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
