"""Loopback ports for the servers the tests start, chosen below the kernel's ephemeral range.

A port found by binding port 0 lies in the ephemeral range (``ip_local_port_range``). Between the
test closing that probe and the server binding the port — a spawned process, seconds later — any
outgoing connection on the machine may take it as its local port: CI saw a P2P engine fail with
``Address already in use`` that way. A port below the range is taken only by an explicit bind, and
this module never hands the same one out twice in a process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10_000
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port() -> int:
    """A port on 127.0.0.1 that nothing was bound to just now and no outgoing socket will take."""
    high = _ephemeral_low()
    rng = random.Random()
    for _ in range(1_000):
        port = rng.randrange(_LOWEST, high)
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in [{_LOWEST}, {high})")
