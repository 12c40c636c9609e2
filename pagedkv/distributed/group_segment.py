"""GroupSegment: the shared memory of one tensor-parallel group on one host, private to its ranks.

Rank 0 creates it with ``memfd_create``: an anonymous file that never has a name in any
directory, mode 0600, so nothing can be left behind, even by SIGKILL (the memory goes with the
last mapping). The other ranks reach it through ``/proc/<rank 0's pid>/fd/<fd>``, which only
the owner (or root) may open, and check the random nonce rank 0 wrote into its header and into
the group's FileStore (a private directory): a pid that names another process is refused. Once
every rank has said through the store whether it mapped the segment, rank 0 closes its
descriptor; the mappings are all that keep it (with the anonymous duplicate descriptor
Python's mmap holds while mapped). The group uses the segment only if every rank
mapped it (``meet`` returns None otherwise, on every rank alike).

Layout (bytes; ``csrc/shm_all_reduce.cpp`` reads the same numbers)::

    0                               magic, nonce
    64                              the "closed" word (see shm_all_reduce.py)
    128 + 64 * r                    rank r's sequence counter (its own cache line)
    HEADER_BYTES + (2r + p) * slot  rank r's data slot for sequence numbers of parity p

Pages are only backed once touched: a slot holds what the largest message so far needed.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets

import torch
from torch.distributed import Store

logger = logging.getLogger(__name__)

_MAGIC = b"pagedkv-tp-shm-1"
_NONCE_BYTES = 16
HEADER_BYTES = 4096
#: Counters at 128 + 64 r must stay inside the header.
MAX_WORLD_SIZE = (HEADER_BYTES - 128) // 64
CLOSED_WORD = 8  # int64 index of the "closed" word
_NONE = "none"


class GroupSegment:
    """A mapped segment: ``buffer`` (uint8, the whole segment) and ``header`` (int64 words).
    Unmapped when the object goes (the last rank to unmap frees the memory)."""

    def __init__(self, mapping: mmap.mmap, world_size: int, slot_bytes: int) -> None:
        self._mapping = mapping
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        self.header = self.buffer[:HEADER_BYTES].numpy().view("int64")

    @staticmethod
    def size_for(world_size: int, slot_bytes: int) -> int:
        return HEADER_BYTES + 2 * world_size * slot_bytes

    @classmethod
    def meet(
        cls, store: Store, rank: int, world_size: int, slot_bytes: int, usable: bool
    ) -> GroupSegment | None:
        """Every rank's segment, or None on every rank when one of them can't map it (or is
        not ``usable``: its caller can't run the collectives here)."""
        if world_size > MAX_WORLD_SIZE:
            usable = False
        size = cls.size_for(world_size, slot_bytes)
        fd = None
        mapping = None
        if rank == 0:
            fd, mapping, address = _create(size) if usable else (None, None, _NONE)
            store.set("address", address)
        elif usable:
            mapping = _attach(store.get("address").decode(), size)
        store.set(f"mapped/{rank}", "1" if mapping is not None else "0")
        keys = [f"mapped/{r}" for r in range(world_size)]
        store.wait(keys)
        everyone = all(store.get(key) == b"1" for key in keys)
        if fd is not None:
            os.close(fd)
        if mapping is None:
            return None
        if not everyone:
            mapping.close()
            return None
        return cls(mapping, world_size, slot_bytes)


def _create(size: int) -> tuple[int | None, mmap.mmap | None, str]:
    """Rank 0: a fresh segment's descriptor, mapping and address (``pid:fd:nonce``)."""
    try:
        fd = os.memfd_create("pagedkv-tp", os.MFD_CLOEXEC)
    except OSError as e:
        logger.warning("no shared memory for the tensor-parallel group (%s): gloo instead", e)
        return None, None, _NONE
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
    except OSError as e:
        os.close(fd)
        logger.warning("no shared memory for the tensor-parallel group (%s): gloo instead", e)
        return None, None, _NONE
    nonce = secrets.token_bytes(_NONCE_BYTES)
    mapping[: len(_MAGIC) + _NONCE_BYTES] = _MAGIC + nonce
    return fd, mapping, f"{os.getpid()}:{fd}:{nonce.hex()}"


def _attach(address: str, size: int) -> mmap.mmap | None:
    """Another rank: rank 0's segment at ``address``, or None (warned) when it can't be had."""
    if address == _NONE:
        return None
    pid, fd_number, nonce = address.split(":")
    try:
        fd = os.open(f"/proc/{pid}/fd/{fd_number}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        logger.warning("can't open rank 0's shared memory (%s): gloo instead", e.strerror)
        return None
    try:
        mapping = mmap.mmap(fd, size) if os.fstat(fd).st_size == size else None
    finally:
        os.close(fd)
    if mapping is None or mapping[: len(_MAGIC) + _NONCE_BYTES] != _MAGIC + bytes.fromhex(nonce):
        if mapping is not None:
            mapping.close()
        logger.warning("the segment at rank 0's address is not the group's: gloo instead")
        return None
    return mapping
