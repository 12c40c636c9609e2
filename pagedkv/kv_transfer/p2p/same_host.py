"""Which wire a new pair group uses: agreed by both ranks over the pair's rendezvous store
(carried by the authenticated control plane) before any gloo setup.

Each rank sets ``host/<rank>``: its boot id, its pid, and why it can't or won't use shared
memory (``same_host_transport`` "network", not Linux x86-64). When neither has a reason and
the boot ids are equal, rank 0 creates the segment and sets ``shm/segment`` (its address);
rank 1 maps it and sets ``shm/attached`` ("ok", or why not). Both then know the same answer:
a ``ShmWire``, or None and the reason, and the group falls back to gloo. A mismatched boot
(another host, or a VM) or a pid that is not the peer's (another pid namespace: the segment's
nonce does not match) falls back the same way.
"""

from __future__ import annotations

import json
import os

from pagedkv.kv_transfer.p2p.rendezvous import PairStore
from pagedkv.kv_transfer.p2p.shm_segment import (
    SegmentAddress,
    ShmSegment,
    ShmUnavailable,
    boot_id,
    shm_problem,
)
from pagedkv.kv_transfer.p2p.wire import ShmWire

_OK = "ok"
#: The largest ring a peer may ask this side to map (rank 0 sizes both rings).
MAX_RING_BYTES = 1 << 30


def _host(wanted: bool) -> dict:
    problem = None if wanted else "same_host_transport is network"
    return {"boot": boot_id(), "pid": os.getpid(), "problem": problem or shm_problem()}


def _peer_host(data: bytes) -> dict:
    try:
        host = json.loads(data)
        if not (
            isinstance(host, dict)
            and isinstance(host.get("boot"), str)
            and isinstance(host.get("pid"), int)
            and isinstance(host.get("problem"), str | None)
        ):
            raise ValueError(host)
    except ValueError as e:
        raise ShmUnavailable(f"malformed host description from the peer: {data[:80]!r}") from e
    return host


def agree_on_shm(
    store: PairStore, rank: int, wanted: bool, ring_capacity: int
) -> tuple[ShmWire | None, str]:
    """Called by both ranks during setup: ``(wire, "shared memory")`` or ``(None, why not)``."""
    mine = _host(wanted)
    store.set(f"host/{rank}", json.dumps(mine))
    theirs = _peer_host(store.get(f"host/{1 - rank}"))
    if mine["problem"] or theirs["problem"]:
        return None, mine["problem"] or f"the peer: {theirs['problem']}"
    if mine["boot"] != theirs["boot"]:
        return None, "another host (boot ids differ)"
    if rank == 0:
        segment, address, fd = ShmSegment.create(ring_capacity)
        try:
            store.set("shm/segment", address.encode())
            answer = store.get("shm/attached").decode(errors="replace")
        finally:
            os.close(fd)  # the peer has mapped it (or never will): the mappings keep it
        if answer != _OK:
            return None, answer[:200]
        return ShmWire(segment, 0, theirs["pid"]), "shared memory"
    try:
        address = SegmentAddress.decode(store.get("shm/segment"))
        if address.pid != theirs["pid"] or not 0 < address.ring_capacity <= MAX_RING_BYTES:
            raise ShmUnavailable(f"a segment address that does not fit the peer: {address}")
        wire = ShmWire(ShmSegment.attach(address), 1, theirs["pid"])
    except (ShmUnavailable, OSError) as e:
        store.set("shm/attached", f"the segment could not be mapped: {e}")
        return None, f"the segment could not be mapped: {e}"
    store.set("shm/attached", _OK)
    return wire, "shared memory"
