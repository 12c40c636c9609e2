"""``pagedkv serve`` flags (kept apart from the server so ``--help`` imports nothing heavy)."""

from __future__ import annotations

import argparse
import os

from pagedkv.arg_types import port, positive_float
from pagedkv.engine.engine_args import EngineArgs
from pagedkv.transport.peer_addr import parse_host_ports

DEFAULT_MAX_BODY_BYTES = 8 << 20


def registry_addresses(text: str) -> list[tuple[str, int]]:
    """``--registry``'s proxies: a bad entry is a one-line usage error naming it."""
    try:
        return parse_host_ports(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT[,HOST:PORT...]: {e}") from None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    g.add_argument("--port", type=port, default=8000, help="port (default: %(default)s)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDKV_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDKV_API_KEY)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: the model directory's name)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 (default: %(default)s)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=positive_float,
        default=30.0,
        help="on SIGTERM/SIGINT: seconds in-flight requests get to finish before they are "
        "aborted with an error (default: %(default)s)",
    )
    g.add_argument(
        "--registry",
        type=registry_addresses,
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="register with pagedkv proxies' registries (heartbeats; its role, model, prefix "
        "hashing and KV events endpoint), each proxy independently: a replica without the P2P "
        "connector, a P or D with it (overrides kv_connector_extra_config.proxies)",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server and engine log level (default: %(default)s)",
    )
    EngineArgs.add_cli_args(parser, model_positional=True)
