"""The executor's errors (no torch import: the command line catches them cheaply)."""

from __future__ import annotations


class RankDiedError(RuntimeError):
    """A tensor-parallel rank is gone (or never started): the engine cannot go on."""
