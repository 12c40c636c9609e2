"""Chained block hashes for prefix caching.

The hash of full block ``i`` covers the parent hash (block ``i-1``, or the root hash for block 0),
the block's token ids and its extra keys, so equal hashes mean equal whole prefixes::

    root ─▶ H(root, t[0:16], salt) ─▶ H(h0, t[16:32]) ─▶ H(h1, t[32:48]) ─▶ ...

Only full blocks are hashed, once each, as tokens arrive. The root hash comes from a fixed seed
string (configurable), so every process computes the same hashes: a KV store shared by many
instances can use them as keys.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence

import xxhash

BlockHash = bytes
HashFn = Callable[[bytes], bytes]

DEFAULT_HASH_ALGO = "xxh3_128"
DEFAULT_HASH_SEED = "pagedkv-prefix-cache-v1"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


HASH_FUNCTIONS: dict[str, HashFn] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": _sha256,
}


def get_hash_fn(algo: str) -> HashFn:
    try:
        return HASH_FUNCTIONS[algo]
    except KeyError:
        raise ValueError(
            f"unknown prefix caching hash algorithm {algo!r}; "
            f"choose one of {sorted(HASH_FUNCTIONS)}"
        ) from None


def _encode_extra_key(tag: bytes, value: str) -> bytes:
    raw = value.encode()
    return tag + len(raw).to_bytes(4, "little") + raw


def token_ids_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, the fixed-width form every hash input uses."""
    try:
        words = array("I", token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    if sys.byteorder == "big":  # the same bytes, hence the same hashes, on every machine
        words.byteswap()
    return words.tobytes()


class BlockHasher:
    """Computes the chained hashes of one token sequence's full blocks, incrementally.

    Extra keys: ``cache_salt`` enters the first block only (isolating a tenant's whole cache);
    ``adapter_id`` enters every block (a LoRA adapter changes every block's KV).
    """

    __slots__ = ("block_size", "hash_fn", "root_hash", "algo")

    def __init__(
        self, block_size: int, algo: str = DEFAULT_HASH_ALGO, seed: str = DEFAULT_HASH_SEED
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.algo = algo
        self.hash_fn = get_hash_fn(algo)
        self.root_hash: BlockHash = self.hash_fn(seed.encode())

    def update(
        self,
        block_hashes: list[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> None:
        """Append to ``block_hashes`` the hashes of blocks of ``token_ids`` that became full."""
        bs = self.block_size
        start = len(block_hashes)
        end = len(token_ids) // bs
        if end <= start:
            return
        data = token_ids_to_bytes(token_ids[start * bs : end * bs])
        adapter = _encode_extra_key(b"a", adapter_id) if adapter_id is not None else b""
        parent = block_hashes[-1] if start else self.root_hash
        hash_fn = self.hash_fn
        step = bs * 4
        first = 0
        if start == 0 and cache_salt is not None:
            parent = hash_fn(parent + data[:step] + _encode_extra_key(b"s", cache_salt) + adapter)
            block_hashes.append(parent)
            first = step
        append = block_hashes.append
        for pos in range(first, len(data), step):
            parent = hash_fn(parent + data[pos : pos + step] + adapter)
            append(parent)

    def hash_token_ids(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids``."""
        block_hashes: list[BlockHash] = []
        self.update(block_hashes, token_ids, cache_salt, adapter_id)
        return block_hashes
