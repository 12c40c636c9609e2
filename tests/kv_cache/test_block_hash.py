"""Chained block hashes: algorithm choice, determinism across processes, incremental hashing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.kv_cache import BlockHasher
from pagedkv.kv_cache.block_hash import DEFAULT_HASH_ALGO, DEFAULT_HASH_SEED, token_ids_to_bytes

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENS = list(range(1000, 1100))  # 6 full blocks of 16, and 4 tokens


@pytest.mark.parametrize(("algo", "size"), [("sha256", 32), ("xxh3_128", 16)])
def test_algo_selects_hash_length(algo, size):
    hasher = BlockHasher(16, algo)
    hashes = hasher.hash_token_ids(TOKENS)
    assert len(hashes) == 6
    assert {len(h) for h in hashes} == {size}
    assert len(set(hashes)) == 6


def test_default_algo_is_xxh3_128():
    assert DEFAULT_HASH_ALGO == "xxh3_128"
    assert BlockHasher(16).hash_token_ids(TOKENS) == BlockHasher(16, "xxh3_128").hash_token_ids(
        TOKENS
    )
    assert BlockHasher(16).hash_token_ids(TOKENS) != BlockHasher(16, "sha256").hash_token_ids(
        TOKENS
    )


def test_unknown_algo():
    with pytest.raises(ValueError, match="'md5'.*sha256.*xxh3_128"):
        BlockHasher(16, "md5")


def test_chain_layout():
    """hash_0 = H(root + tokens_0), hash_i = H(hash_{i-1} + tokens_i); root = H(seed)."""
    hasher = BlockHasher(16, "sha256")
    assert hasher.root_hash == hasher.hash_fn(DEFAULT_HASH_SEED.encode())
    hashes = hasher.hash_token_ids(TOKENS)
    parent = hasher.root_hash
    for i, h in enumerate(hashes):
        assert h == hasher.hash_fn(parent + token_ids_to_bytes(TOKENS[16 * i : 16 * (i + 1)]))
        parent = h
    # A different seed (e.g. another model) changes every hash.
    other = BlockHasher(16, "sha256", seed="another-model").hash_token_ids(TOKENS)
    assert all(a != b for a, b in zip(hashes, other))


def test_chaining_propagates_a_change():
    hasher = BlockHasher(16)
    base = hasher.hash_token_ids(TOKENS)
    changed = hasher.hash_token_ids([0, *TOKENS[1:]])
    assert all(a != b for a, b in zip(base, changed))
    tail_changed = hasher.hash_token_ids(TOKENS[:40] + [0] + TOKENS[41:])
    assert tail_changed[:2] == base[:2]
    assert all(a != b for a, b in zip(base[2:], tail_changed[2:]))


def test_only_full_blocks_are_hashed():
    hasher = BlockHasher(16)
    assert hasher.hash_token_ids(TOKENS[:15]) == []
    assert len(hasher.hash_token_ids(TOKENS[:16])) == 1
    assert len(hasher.hash_token_ids(TOKENS[:47])) == 2


def test_deterministic_across_processes():
    """Another interpreter (another hash seed for str) computes the same bytes."""
    script = (
        "import json; from pagedkv.kv_cache import BlockHasher\n"
        "toks = list(range(1000, 1100))\n"
        "out = {a: [h.hex() for h in BlockHasher(16, a).hash_token_ids(toks, 'salt', 'lora')]"
        " for a in ('sha256', 'xxh3_128')}\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    theirs = json.loads(proc.stdout)
    for algo in ("sha256", "xxh3_128"):
        ours = BlockHasher(16, algo).hash_token_ids(TOKENS, "salt", "lora")
        assert [h.hex() for h in ours] == theirs[algo]


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.integers(1, 8),
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=6),
    cache_salt=st.none() | st.sampled_from(["", "s", "tenant"]),
    adapter_id=st.none() | st.sampled_from(["", "lora"]),
    algo=st.sampled_from(["sha256", "xxh3_128"]),
)
def test_incremental_equals_one_shot(block_size, token_ids, cuts, cache_salt, adapter_id, algo):
    hasher = BlockHasher(block_size, algo)
    one_shot = hasher.hash_token_ids(token_ids, cache_salt, adapter_id)
    assert len(one_shot) == len(token_ids) // block_size
    incremental: list[bytes] = []
    for cut in [*sorted(cuts), len(token_ids)]:
        hasher.update(incremental, token_ids[:cut], cache_salt, adapter_id)
        # Only full blocks, each hashed once, equal to the one-shot prefix.
        assert incremental == one_shot[: min(cut, len(token_ids)) // block_size]
    assert incremental == one_shot


def test_extra_keys_are_unambiguous():
    hasher = BlockHasher(4)
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    variants = [
        hasher.hash_token_ids(toks),
        hasher.hash_token_ids(toks, cache_salt="x"),
        hasher.hash_token_ids(toks, adapter_id="x"),
        hasher.hash_token_ids(toks, cache_salt="x", adapter_id="x"),
        hasher.hash_token_ids(toks, cache_salt=""),
        hasher.hash_token_ids(toks, adapter_id=""),
    ]
    firsts = [v[0] for v in variants]
    assert len(set(firsts)) == len(firsts)


def test_token_bytes_are_little_endian_uint32_on_every_machine() -> None:
    """Hashes key a store shared by many machines: the bytes may not follow the host's order."""
    from pagedkv.kv_cache.block_hash import token_ids_to_bytes

    assert token_ids_to_bytes([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"
