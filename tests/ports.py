"""Loopback ports for the servers the tests start, chosen below the kernel's ephemeral range.

A port found by binding port 0 lies in the ephemeral range (``ip_local_port_range``). Between the
test closing that probe and the server binding the port — a spawned process, seconds later — any
outgoing connection on the machine may take it as its local port: CI saw a P2P engine fail with
``Address already in use`` that way. A port below the range is taken only by an explicit bind, and
this module never hands the same one out twice in a process, nor (under pytest-xdist) one that
another worker may hand out.
"""

from __future__ import annotations

import os
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


def _worker_share() -> tuple[int, int]:
    """(this pytest-xdist worker's index, the number of workers): each worker takes the ports
    congruent to its index, so two workers never race for one. (0, 1) without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return int(worker) % count, count


def free_port() -> int:
    """A port on 127.0.0.1 that nothing was bound to just now and no outgoing socket will take."""
    high = _ephemeral_low()
    index, count = _worker_share()
    rng = random.Random()
    for _ in range(1_000):
        port = rng.randrange(_LOWEST, high)
        port -= (port - index) % count
        if port < _LOWEST or port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in [{_LOWEST}, {high})")


#: Ports a ``free_port_range`` comes from, below the single ports: aligned blocks of
#: ``_BLOCK``, each pytest-xdist worker taking every ``count``-th block.
_RANGES_LOWEST = 6_000
_BLOCK = 8


def free_port_range(n: int) -> int:
    """The first of ``n`` (at most 8) consecutive free ports on 127.0.0.1: an instance's
    tensor-parallel ranks listen on ``kv_port + rank``."""
    assert 0 < n <= _BLOCK
    index, count = _worker_share()
    rng = random.Random()
    for _ in range(1_000):
        base = rng.randrange(_RANGES_LOWEST, _LOWEST) // _BLOCK * _BLOCK
        if (base // _BLOCK) % count != index:
            continue
        ports = range(base, base + n)
        if any(port in _handed_out or not _bindable(port) for port in ports):
            continue
        _handed_out.update(ports)
        return base
    raise RuntimeError(f"no {n} free consecutive loopback ports in [{_RANGES_LOWEST}, {_LOWEST})")


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
