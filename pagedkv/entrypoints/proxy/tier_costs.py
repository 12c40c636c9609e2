"""What serving one prompt token from each KV tier costs ``kv_aware`` routing, in recomputed
tokens (``--kv-tier-cost``), Dynamo-style: a hit is credited by where it is.

A token in the instance's own pool ("GPU") costs nothing; one it must compute costs 1. A token
in a tier below the pool must be loaded back first: cheaper than recompute, dearer than a pool
hit, and dearer the farther down it is. The defaults are the load time over the compute time
of one token's KV, for a mid-size dense model (Llama-3-8B: 16 GFLOP and 128 KiB of KV per
token; about 27 µs to compute at 600 TFLOP/s), rounded up, since a load also takes a slot of
the instance's bounded load pool and the request waits for it whole:

    =======  ==========================================  ===========  ======
    medium   path                                        µs / token   cost
    =======  ==========================================  ===========  ======
    GPU      the pool itself                             0            0.0
    CPU      host memory over PCIe 5 (~50 GB/s)          ~2.6         0.1
    DISK     local NVMe (a few drives, ~20 GB/s)         ~6.5         0.3
    REMOTE   the shared store over the network (RDMA     ~10 and      0.5
             ~12 GB/s; TCP slower)                       more
    =======  ==========================================  ===========  ======

Only the order matters to most choices (pool < host < disk < remote < recompute); the flag
sets other values for other hardware and models. A medium the table lacks (another engine's
name for a tier) costs ``UNKNOWN_TIER_COST``: held, but credited nothing.

The media are ``kv_cache/kv_events.py``'s (spelled out here: this module imports nothing
heavy, as ``cli_args`` reads the defaults for ``--help``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping

#: Each tier's cost of serving a token, as a fraction of recomputing it.
DEFAULT_TIER_COSTS: Mapping[str, float] = {"GPU": 0.0, "CPU": 0.1, "DISK": 0.3, "REMOTE": 0.5}
#: A medium without a cost: as dear as recompute.
UNKNOWN_TIER_COST = 1.0


def normalize_medium(medium: str | None) -> str:
    """An event's ``medium`` as the index keys it: upper case; none given is the pool (vLLM
    sent none before its offloading events)."""
    return medium.upper() if medium else "GPU"


def tier_cost(costs: Mapping[str, float], medium: str) -> float:
    return costs.get(medium, UNKNOWN_TIER_COST)


def parse_tier_costs(text: str) -> dict[str, float]:
    """``MEDIUM=COST[,MEDIUM=COST...]`` (COST in [0, 1]) over the defaults: for argparse."""
    costs = dict(DEFAULT_TIER_COSTS)
    for item in text.split(","):
        medium, sep, value = item.partition("=")
        try:
            cost = float(value) if sep and medium.strip() else math.nan
        except ValueError:
            cost = math.nan
        if not 0.0 <= cost <= 1.0:
            raise argparse.ArgumentTypeError(
                f"must be MEDIUM=COST[,MEDIUM=COST...] with COST in [0, 1] "
                f"(e.g. CPU=0.1,DISK=0.3), got {item!r}"
            )
        costs[normalize_medium(medium.strip())] = cost
    return costs


def format_tier_costs(costs: Mapping[str, float]) -> str:
    """The flag's form of ``costs`` (for ``--help``)."""
    return ",".join(f"{medium}={cost:g}" for medium, cost in costs.items())
