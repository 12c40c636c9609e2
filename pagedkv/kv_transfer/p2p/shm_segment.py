"""ShmSegment: the shared memory of one same-host pair group, private to its two processes.

Rank 0 creates it with ``memfd_create``: an anonymous file that never has a name in any
directory (nothing to guess, nothing to unlink, nothing left behind when a process is killed:
the memory goes with the last mapping), mode 0600. Rank 1 reaches it through
``/proc/<rank 0's pid>/fd/<fd>``, which only the owner (or root) may open, and checks the
random nonce rank 0 wrote into its header and sent over the authenticated control plane: a
pid that names another process (another pid namespace, a reused pid) is refused. Once rank 1
has mapped it, both close their descriptors; the mappings are all that keep it.

Layout: a header page (magic, nonce, and a word either side sets when it tears the pair down,
so the other side's lanes stop waiting at once, as a closed socket tells gloo), then one ring
per direction (``ring(0)``: rank 0 -> rank 1, ``ring(1)``: rank 1 -> rank 0; shm_ring.py).
Pages are only backed once touched, so the direction a pair never uses costs nothing.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.kv_transfer.p2p.shm_ring import ShmRing, ring_bytes

_MAGIC = b"pagedkv-shm-v1\0\0"
_HEADER_BYTES = 4096
_NONCE_BYTES = 16
_CLOSED_WORD = 8  # int64 index in the header: set once either side tore the pair down


class ShmUnavailable(RuntimeError):
    """The segment can't be made or reached here: the pair uses the network path."""


def boot_id() -> str:
    """This boot of this host: equal on two processes iff they share a kernel (and so may
    share memory)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def shm_problem() -> str | None:
    """Why this process can't use the shared-memory path, or None."""
    if not hasattr(os, "memfd_create") or not hasattr(os, "pidfd_open"):
        return "no memfd_create/pidfd_open (Linux only)"
    if platform.machine() not in ("x86_64", "AMD64"):
        # The rings publish with plain 8-byte stores after the data: ordered on x86-64 (TSO),
        # not on weaker memory models without fences.
        return f"the ring's ordering needs x86-64 (this is {platform.machine()})"
    if not boot_id():
        return "no boot id"
    return None


@dataclass(frozen=True)
class SegmentAddress:
    """How rank 1 finds rank 0's segment (sent over the authenticated control plane)."""

    pid: int
    fd: int
    nonce: str  # hex
    ring_capacity: int

    def encode(self) -> bytes:
        return f"{self.pid}:{self.fd}:{self.nonce}:{self.ring_capacity}".encode()

    @classmethod
    def decode(cls, data: bytes) -> SegmentAddress:
        try:
            pid, fd, nonce, capacity = data.decode().split(":")
            return cls(int(pid), int(fd), nonce, int(capacity))
        except ValueError as e:
            raise ShmUnavailable(f"malformed segment address {data[:80]!r}") from e


class ShmSegment:
    """A mapped segment: its header and its two rings."""

    def __init__(self, mapping: mmap.mmap, ring_capacity: int) -> None:
        self._mapping = mapping
        self.ring_capacity = ring_capacity
        self._buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        self._header = self._buffer[:_HEADER_BYTES].numpy().view("int64")
        size = ring_bytes(ring_capacity)
        self._rings = [
            ShmRing(self._buffer[_HEADER_BYTES + i * size : _HEADER_BYTES + (i + 1) * size])
            for i in (0, 1)
        ]

    @staticmethod
    def size_for(ring_capacity: int) -> int:
        return _HEADER_BYTES + 2 * ring_bytes(ring_capacity)

    @classmethod
    def create(cls, ring_capacity: int) -> tuple[ShmSegment, SegmentAddress, int]:
        """Rank 0: a fresh segment, its address and the fd to close once rank 1 has it."""
        fd = os.memfd_create("pagedkv-p2p", os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, cls.size_for(ring_capacity))
            mapping = mmap.mmap(fd, cls.size_for(ring_capacity))
        except OSError:
            os.close(fd)
            raise
        nonce = secrets.token_bytes(_NONCE_BYTES)
        mapping[: len(_MAGIC) + _NONCE_BYTES] = _MAGIC + nonce
        address = SegmentAddress(os.getpid(), fd, nonce.hex(), ring_capacity)
        return cls(mapping, ring_capacity), address, fd

    @classmethod
    def attach(cls, address: SegmentAddress) -> ShmSegment:
        """Rank 1: map rank 0's segment, or raise ShmUnavailable saying why."""
        path = f"/proc/{address.pid}/fd/{address.fd}"
        size = cls.size_for(address.ring_capacity)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise ShmUnavailable(f"can't open the peer's segment ({e.strerror})") from e
        try:
            if os.fstat(fd).st_size != size:
                raise ShmUnavailable("the peer's segment has another size")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if mapping[: len(_MAGIC) + _NONCE_BYTES] != _MAGIC + bytes.fromhex(address.nonce):
            mapping.close()
            raise ShmUnavailable("the segment at the peer's address is not the peer's")
        return cls(mapping, address.ring_capacity)

    def close_pair(self) -> None:
        """This side tore the pair down: the peer's lanes stop waiting on it at once."""
        self._header[_CLOSED_WORD] = 1

    @property
    def pair_closed(self) -> bool:
        return bool(self._header[_CLOSED_WORD])

    def ring(self, sender_rank: int) -> ShmRing:
        """The ring rank ``sender_rank`` writes and its peer reads."""
        return self._rings[sender_rank]
