"""``pagedkv proxy`` flags (kept apart from the app so ``--help`` imports nothing heavy)."""

from __future__ import annotations

import argparse
import os

from pagedkv.arg_types import non_negative_float, non_negative_int, positive_float, positive_int
from pagedkv.engine.engine_args import DEFAULT_MODEL_PATH
from pagedkv.entrypoints.proxy.router import ROUTING_POLICIES
from pagedkv.entrypoints.proxy.tier_costs import (
    DEFAULT_TIER_COSTS,
    format_tier_costs,
    parse_tier_costs,
)

#: ProxyConfig.fallback's values (here too, so ``--help`` imports nothing heavy).
FALLBACKS = ("none", "local")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("proxy")
    g.add_argument(
        "--host", default="127.0.0.1", help="HTTP address to bind (default: %(default)s)"
    )
    g.add_argument("--port", type=int, default=10001, help="HTTP port (default: %(default)s)")
    g.add_argument(
        "--registry-host",
        default="127.0.0.1",
        help="address of the ZMQ registry instances register with (default: %(default)s)",
    )
    g.add_argument(
        "--registry-port", type=int, default=30001, help="registry port (default: %(default)s)"
    )
    _add_routing_args(g)
    _add_upstream_args(g)
    g.add_argument(
        "--shutdown-timeout",
        type=positive_float,
        default=30.0,
        help="on SIGTERM/SIGINT: seconds in-flight requests get to finish before they are "
        "ended with an error (default: %(default)s)",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _add_routing_args(g: argparse._ArgumentGroup) -> None:
    """How requests are routed, and what the router reads to route them."""
    g.add_argument(
        "--routing",
        default="round_robin",
        choices=ROUTING_POLICIES,
        help="kv_aware: the instance (and P) with the fewest uncached prompt tokens (one held "
        "in a tier below its pool counts as --kv-tier-cost of one) plus --load-weight x its "
        "load, from the instances' KV events; ties (within a block) go "
        "to the one sent the fewest tokens to compute lately (default: %(default)s)",
    )
    g.add_argument(
        "--load-weight",
        type=non_negative_float,
        default=32.0,
        help="kv_aware: prompt tokens one request in flight at an instance is worth "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--kv-tier-cost",
        type=parse_tier_costs,
        default=dict(DEFAULT_TIER_COSTS),
        metavar="MEDIUM=COST[,...]",
        help="kv_aware: what serving a prompt token from each KV tier costs, as a fraction of "
        "recomputing it (GPU: the instance's pool; CPU, DISK, REMOTE: its offloading tiers); "
        "the media given replace their defaults (default: "
        f"{format_tier_costs(DEFAULT_TIER_COSTS)})",
    )
    g.add_argument(
        "--disagg-threshold",
        type=non_negative_int,
        default=0,
        help="a decode instance that lacks fewer than N prompt tokens prefills them itself, "
        "without a prefill instance (default: 0, always disaggregate)",
    )
    g.add_argument(
        "--tokenizer",
        default=str(DEFAULT_MODEL_PATH),
        help="the instances' tokenizer, for kv_aware and --disagg-threshold (default: the "
        "built-in model's)",
    )


def _add_upstream_args(g: argparse._ArgumentGroup) -> None:
    """The keys, timeouts and retries of what the proxy sends on."""
    g.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDKV_PROXY_API_KEY"),
        help="require 'Authorization: Bearer KEY' from clients (default: $PAGEDKV_PROXY_API_KEY)",
    )
    g.add_argument(
        "--upstream-api-key",
        default=os.environ.get("PAGEDKV_API_KEY"),
        help="the key the proxy sends to the instances (default: $PAGEDKV_API_KEY)",
    )
    g.add_argument(
        "--instance-timeout",
        type=positive_float,
        default=6.0,
        help="drop an instance after this many seconds without a heartbeat (default: %(default)s)",
    )
    g.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=5.0,
        help="upstream connect timeout, seconds",
    )
    g.add_argument(
        "--request-timeout",
        type=positive_float,
        default=600.0,
        help="longest wait for any upstream byte, seconds (default: %(default)s)",
    )
    g.add_argument(
        "--max-attempts",
        type=positive_int,
        default=3,
        help="P/D pairs tried per request before answering 503 (default: %(default)s)",
    )
    g.add_argument(
        "--fallback",
        default="none",
        choices=FALLBACKS,
        help="local: when P or the KV transfer fails, send the request to a decode instance "
        "alone, which prefills it itself (default: %(default)s: retry another pair)",
    )
