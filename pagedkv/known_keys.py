"""``from_known_keys``: a config dataclass from a user's dict, an unknown key a clear error."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def from_known_keys(
    cls: type[T], values: Mapping[str, Any], what: str, also_known: Iterable[str] = ()
) -> T:
    """``cls(**values)`` when every key is a field of ``cls``; else one ValueError naming the
    unknown keys and the known ones (``what`` says whose keys: "kv_transfer_config field(s)").
    ``also_known`` keys are accepted and left out (another reader takes them)."""
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    known = fields | set(also_known)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; known: {sorted(known)}")
    return cls(**{k: v for k, v in values.items() if k in fields})
