"""The disk tier's data plane on a real filesystem: values survive a restart and are found by
``scan``; other models' files, garbage and leftovers are told apart; and every fault (a file
cut short or flipped under us, a full disk, a directory that cannot be written) surfaces as a
``StoreError`` or a miss, never as wrong bytes."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pagedkv.kv_transfer.offload.disk_store import DiskStore
from pagedkv.kv_transfer.store.backends.base import StoreError, StoreUnavailable
from pagedkv.kv_transfer.store.block_codec import (
    HEADER_SIZE,
    CorruptValue,
    ValueBatch,
    block_key,
    decode_value,
    head_key,
)

FP = "tiny-fp16-abc123"
PAYLOAD = 1024


def put(store: DiskStore, fingerprint: str, hashes: range, payload: int = PAYLOAD) -> dict:
    """Seals and stores one value per hash (KV head 0 of the block); returns key -> payload."""
    keys = [head_key(block_key(fingerprint, 0, i.to_bytes(8, "big")), 0) for i in hashes]
    batch = ValueBatch(len(keys), payload)
    batch.payloads[:] = np.random.default_rng(hashes.start).integers(
        0, 256, batch.payloads.shape, dtype=np.uint8
    )
    batch.seal(keys)
    store.backend.put_from(keys, batch.buffer)
    return {key: bytes(row) for key, row in zip(keys, batch.payloads)}


def load(store: DiskStore, key: str, payload: int = PAYLOAD) -> bytes | None:
    """What a load finds: the payload, or None for a miss (``CorruptValue`` propagates)."""
    (value,) = store.backend.get_many([key])
    return None if value is None else bytes(decode_value(key, value, payload))


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "256k") -> Iterator[Path]:
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    result = subprocess.run(mount, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_values_survive_a_restart_and_scan_oldest_first(tmp_path: Path):
    root = tmp_path / "cache" / "kv"
    store = DiskStore(root, FP)
    assert root.stat().st_mode & 0o777 == 0o700
    payloads = put(store, FP, range(0, 3))
    for age, key in enumerate(payloads):  # the first key oldest
        os.utime(store.backend.path_of(key), (1e9 + age, 1e9 + age))
    assert store.scan() == [
        (key, HEADER_SIZE + PAYLOAD, 1e9 + age) for age, key in enumerate(payloads)
    ]

    restarted = DiskStore(root, FP, fsync=True)
    assert [key for key, _, _ in restarted.scan()] == list(payloads)
    assert restarted.usage_bytes() == 3 * (HEADER_SIZE + PAYLOAD)
    for key, payload in payloads.items():
        assert load(restarted, key) == payload
    restarted.backend.delete_many(list(payloads)[:1])
    assert len(restarted.scan()) == 2 and restarted.usage_bytes() == 2 * (HEADER_SIZE + PAYLOAD)


def test_scan_skips_other_models_and_garbage_and_deletes_leftovers(tmp_path: Path):
    store = DiskStore(tmp_path, FP)
    ours = put(store, FP, range(0, 4))
    other = DiskStore(tmp_path, "another-model")
    theirs = put(other, "another-model", range(10, 12), payload=512)
    extended = DiskStore(tmp_path, f"{FP}:v2")  # ours as a prefix: still another model
    put(extended, f"{FP}:v2", range(20, 21))
    a_value = store.backend.path_of(next(iter(ours)))
    subdir = a_value.parent
    garbage = {
        subdir / "random.kv": os.urandom(300),
        subdir / "short.kv": a_value.read_bytes()[:100],  # not even a header
        subdir / "copied.kv": a_value.read_bytes(),  # valid, but not where a load looks
        subdir / "notes.txt": b"hello",
        tmp_path / "stray.kv": a_value.read_bytes(),
        tmp_path / "zz" / "ffff.kv": os.urandom(HEADER_SIZE),
        tmp_path / "toolong" / "x.kv": a_value.read_bytes(),
    }
    for path, data in garbage.items():
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
    leftovers = [
        subdir / ".abc123.tmp",
        other.backend.path_of(next(iter(theirs))).parent / ".q.tmp",
    ]
    for path in leftovers:
        path.write_bytes(b"half a value")

    assert sorted(key for key, _, _ in store.scan()) == sorted(ours)
    assert not any(path.exists() for path in leftovers)
    assert all(path.exists() for path in garbage)  # not ours to delete
    assert sorted(key for key, _, _ in other.scan()) == sorted(theirs)
    assert len(extended.scan()) == 1
    assert store.usage_bytes() == 4 * (HEADER_SIZE + PAYLOAD)
    assert other.usage_bytes() == 2 * (HEADER_SIZE + 512)


def test_a_file_cut_short_or_flipped_under_us_never_loads(tmp_path: Path):
    store = DiskStore(tmp_path, FP)
    payloads = put(store, FP, range(0, 3))
    cut, flipped, intact = payloads
    os.truncate(store.backend.path_of(cut), HEADER_SIZE + PAYLOAD - 7)
    path = store.backend.path_of(flipped)
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 100] ^= 0x01
    path.write_bytes(data)

    for key in (cut, flipped):
        with pytest.raises(CorruptValue):
            load(store, key)
    assert load(store, intact) == payloads[intact]
    # A restart drops the file cut short (it can never load); the flipped one has a good header,
    # so it is listed until a load finds it bad and the tier deletes it.
    assert sorted(key for key, _, _ in store.scan()) == sorted([flipped, intact])
    assert not store.backend.path_of(cut).exists()
    store.backend.delete_many([flipped])
    assert load(store, flipped) is None


def test_a_full_disk_fails_the_put_and_leaves_nothing_partial(tmp_path: Path):
    with tmpfs(tmp_path / "mnt") as mnt:
        store = DiskStore(mnt / "kv", FP)
        payload = 48 << 10
        with pytest.raises(StoreError) as failure:
            for start in range(0, 64, 2):
                put(store, FP, range(start, start + 2), payload=payload)
        assert not isinstance(failure.value, StoreUnavailable)  # full is not unreachable
        assert "No space left" in str(failure.value)
        assert not [p for p in files_under(mnt) if p.name.endswith(".tmp")]
        entries = store.scan()
        assert 0 < len(entries) == len(files_under(mnt))
        for key, size, _ in entries:
            assert size == HEADER_SIZE + payload and load(store, key, payload) is not None
        assert store.usage_bytes() == len(entries) * (HEADER_SIZE + payload)

        store.backend.delete_many([key for key, _, _ in entries])  # eviction frees the space
        put(store, FP, range(100, 102), payload=payload)
        assert len(store.scan()) == 2


def test_a_directory_that_cannot_be_written_is_refused_by_name(tmp_path: Path):
    (tmp_path / "afile").write_bytes(b"")
    under_a_file = tmp_path / "afile" / "kv"
    with pytest.raises(StoreError, match=str(under_a_file)):
        DiskStore(under_a_file, FP)

    with tmpfs(tmp_path / "mnt") as mnt:
        (mnt / "existing").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        for root in (mnt / "existing", mnt / "new" / "kv"):
            with pytest.raises(StoreError, match=str(root)):
                DiskStore(root, FP)


def test_scan_of_a_vanished_directory_is_a_store_error(tmp_path: Path):
    store = DiskStore(tmp_path / "kv", FP)
    put(store, FP, range(0, 1))
    shutil.rmtree(tmp_path / "kv")
    with pytest.raises(StoreError, match=str(tmp_path / "kv")):
        store.scan()
    assert load(store, head_key(block_key(FP, 0, (0).to_bytes(8, "big")), 0)) is None
