"""Small integer helpers shared by every layer (no imports beyond the standard library)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def round_down(x: int, multiple: int) -> int:
    return x - x % multiple
