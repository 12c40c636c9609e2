"""A MultiConnector's stats: each child's, its names prefixed by the child's word.

The rule: a child's stat ``num_<rest>`` becomes ``num_<prefix>_<rest>`` (still a counter: the
exporter counts names that start with ``num_``), any other ``<stat>`` becomes
``<prefix>_<stat>``; a name whose ``<rest>`` (or ``<stat>``) already starts with
``<prefix>_`` is kept. The prefix is the one the connector registered with
(``register_connector(..., stats_prefix=...)``, by default its name without ``Connector``,
lowercased: ``p2p``, ``store``); two children with one prefix get ``<prefix>``, ``<prefix>_2``...
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_transfer.factory import stats_prefix


def child_prefixes(configs: Sequence[KVTransferConfig]) -> list[str]:
    seen: Counter[str] = Counter()
    prefixes = []
    for config in configs:
        prefix = stats_prefix(config)
        seen[prefix] += 1
        prefixes.append(prefix if seen[prefix] == 1 else f"{prefix}_{seen[prefix]}")
    return prefixes


def prefixed_name(prefix: str, stat: str) -> str:
    counter = stat.startswith("num_")
    rest = stat.removeprefix("num_")
    if not rest.startswith(f"{prefix}_"):
        rest = f"{prefix}_{rest}"
    return f"num_{rest}" if counter else rest


def merged_stats(
    prefixes: Sequence[str], stats: Sequence[Mapping[str, int | float]]
) -> dict[str, int | float]:
    """Each child's ``stats``, by position, under its prefix."""
    return {
        prefixed_name(prefix, name): value
        for prefix, child in zip(prefixes, stats, strict=True)
        for name, value in child.items()
    }
