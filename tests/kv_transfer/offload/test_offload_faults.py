"""Tier faults are misses and counters: never an error to the client, never wrong tokens.

A disk file flipped or cut short under the engine, a directory that cannot be written, a full
disk, a remote tier that stalls or vanishes: each run's greedy outputs equal an engine without
tiers, and nothing is left pending or pinned."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.kv_transfer.offload.conftest import (
    SMALL_POOL,
    assert_tiers_idle,
    connector_halves,
    disk_tier,
    generate_each,
    offloading,
    tokens,
)
from tests.kv_transfer.offload.test_disk_store import tmpfs
from tests.tiny_models import random_prompt

PROMPTS = [random_prompt(100, seed) for seed in range(6)]
#: Prompts that are in no tier (lookups of them reach the remote tier).
OTHERS = [random_prompt(100, seed) for seed in range(100, 106)]


def kv_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


def fill_disk_and_restart(make_llm, config: dict):
    first = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
    generate_each(first, PROMPTS)
    assert_tiers_idle(first)
    first.llm_engine.shutdown()


def test_flipped_files_are_misses_and_deleted(make_llm, tmp_path):
    want = tokens(generate_each(make_llm("llama", **SMALL_POOL), PROMPTS))
    config = offloading(disk_tier(tmp_path / "kv"))
    fill_disk_and_restart(make_llm, config)
    files = kv_files(tmp_path / "kv")
    assert len(files) == 6 * 6 * 2  # 6 prompts x 6 blocks x 2 KV heads
    for path in files:  # one payload byte of every block's every head flipped
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(data)
    llm = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
    assert tokens(generate_each(llm, PROMPTS)) == want
    stats = llm.llm_engine.get_kv_connector_stats()
    assert stats["num_offload_disk_load_misses"] > 0
    assert_tiers_idle(llm)  # the corrupt files are gone; what is on disk is indexed


def test_files_cut_short_are_misses(make_llm, tmp_path):
    want = tokens(generate_each(make_llm("llama", **SMALL_POOL), PROMPTS))
    config = offloading(disk_tier(tmp_path / "kv"))
    fill_disk_and_restart(make_llm, config)
    for path in kv_files(tmp_path / "kv"):
        os.truncate(path, path.stat().st_size // 2)
    llm = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
    outputs = generate_each(llm, PROMPTS)
    assert tokens(outputs) == want
    assert [o.num_cached_tokens for o in outputs] == [0] * 6
    assert_tiers_idle(llm)


def test_an_unwritable_directory_disables_the_tier(make_llm, tmp_path, caplog):
    (tmp_path / "a_file").write_text("")
    config = offloading(disk_tier(tmp_path / "a_file" / "kv"))
    want = tokens(generate_each(make_llm("llama", **SMALL_POOL), PROMPTS))
    llm = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
    assert tokens(generate_each(llm, PROMPTS + PROMPTS)) == want + want
    assert "disk tier" in caplog.text and "unusable" in caplog.text
    scheduler_half, _ = connector_halves(llm)
    assert scheduler_half.tiers["disk"].capacity_blocks == 0
    assert_tiers_idle(llm)


def test_a_full_disk_fails_stores_not_requests(make_llm, tmp_path):
    want = tokens(generate_each(make_llm("llama", **SMALL_POOL), PROMPTS + PROMPTS))
    with tmpfs(tmp_path / "small", size="200k") as root:  # room for about 12 of 36 blocks
        config = offloading(disk_tier(root, size_gib=0.01))
        llm = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
        assert tokens(generate_each(llm, PROMPTS + PROMPTS)) == want
        assert_tiers_idle(llm)
        stats = llm.llm_engine.get_kv_connector_stats()
        assert stats["num_offload_disk_store_failures"] > 0
        assert not list(root.rglob("*.tmp"))
        llm.llm_engine.shutdown()


def remote_tier(url: str) -> dict:
    return {"medium": "remote", "store_url": url, "timeout_s": 0.3, "connect_timeout_s": 0.3}


def test_a_stalled_then_vanished_remote_tier_is_a_miss(make_llm, redis_server):
    want = tokens(generate_each(make_llm("llama", **SMALL_POOL), PROMPTS + OTHERS))
    config = offloading(remote_tier(redis_server.url))
    llm = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
    assert tokens(generate_each(llm, PROMPTS)) == want[:6]
    os.kill(redis_server.process.pid, signal.SIGSTOP)  # stalls: every call times out
    try:
        assert tokens(generate_each(llm, OTHERS[:3])) == want[6:9]
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)
    redis_server.stop()  # vanishes
    assert tokens(generate_each(llm, OTHERS[3:])) == want[9:]
    stats = llm.llm_engine.get_kv_connector_stats()
    assert stats["num_offload_remote_lookup_errors"] > 0
    assert_tiers_idle(llm)
