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
    """Looks up, once per forward, the tables every layer applies with ``apply_rotary_emb``.

    As vLLM's ``cos_sin_cache``, the tables are computed once for a range of positions and
    indexed per step: ``[num_positions, head_dim]`` each, grown to the next power of two when a
    position past them comes (a model of 128k positions allocates only what its requests reach).
    A row equals, bit for bit, what the same operations give for that position alone: each value
    is ``cos``/``sin`` of the same fp32 product.
    """

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        # Built on the CPU explicitly, so it is real even when the layers are built on "meta".
        self.register_buffer("inv_freq", compute_inv_freq(rope, head_dim), persistent=False)
        self.register_buffer("cos_cache", None, persistent=False)
        self.register_buffer("signed_sin_cache", None, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, signed_sin)``, each ``[num_tokens, 1, head_dim]``.

        ``signed_sin = cat(-sin, sin)`` so that rotating half the head is one ``roll``.
        """
        needed = int(positions.max()) + 1 if positions.numel() else 1
        cached = self.cos_cache
        if (
            cached is None
            or cached.dtype != dtype
            or cached.device != positions.device
            or cached.shape[0] < needed
        ):
            self._build(needed, dtype, positions.device)
        cos = self.cos_cache.index_select(0, positions)
        signed_sin = self.signed_sin_cache.index_select(0, positions)
        return cos.unsqueeze(1), signed_sin.unsqueeze(1)

    def _build(self, num_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        size = max(1 << (num_positions - 1).bit_length(), 256)
        positions = torch.arange(size, device=device)
        freqs = positions[:, None].float() * self.inv_freq.to(device)
        cos, sin = freqs.cos(), freqs.sin()
        self.cos_cache = torch.cat((cos, cos), dim=-1).to(dtype)
        self.signed_sin_cache = torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, on
    ``[num_tokens, num_heads, head_dim]``."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
