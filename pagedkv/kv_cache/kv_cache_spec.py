"""Per-layer KV cache specs: what one layer stores per block, and how its attention reaches back.

Specs are frozen (hashable) so equal specs group layers together. ``dtype`` is a string such as
``"float16"`` so this module stays free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.utils import cdiv

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """A layer type's KV footprint. One block holds ``block_size`` tokens of K and V."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        _require_positive("block_size", self.block_size)
        _require_positive("num_kv_heads", self.num_kv_heads)
        _require_positive("head_size", self.head_size)
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer, K and V: ``2·block_size·heads·head_size·dtype``."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * DTYPE_SIZES[self.dtype]

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int | None:
        """Most blocks one request can hold at once; None when it keeps every block it fills."""
        return None


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token attends to every earlier token: a request keeps all its blocks."""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(KVCacheSpec):
    """A token attends to the last ``sliding_window`` tokens, itself included."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive("sliding_window", self.sliding_window)

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        # The window (minus the new token) plus the tokens in flight; +1 because the window need
        # not start at a block boundary: block_size 4, window [CDEF] spans [XXCD][EF].
        num_tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(KVCacheSpec):
    """Tokens attend only within their own chunk of ``attention_chunk_size`` tokens (Llama 4)."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive("attention_chunk_size", self.attention_chunk_size)

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        num_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size)
