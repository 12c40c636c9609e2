"""The same-host shared-memory path: its ring (against its invariants, after every
operation), its segment (private, unnamed, refused to a process that is not the peer), and the
engines: a peer killed mid-transfer on either side leaves no segment mapped and no block
received, and a peer on another boot (host) falls back to gloo, visibly. (Every other PD test
runs over shared memory too: it is the default between two processes of one host.)"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.kv_transfer.p2p.shm_ring import NUM_SLOTS, ShmRing, ring_bytes
from pagedkv.kv_transfer.p2p.shm_segment import (
    SegmentAddress,
    ShmSegment,
    ShmUnavailable,
    shm_problem,
)
from tests.kv_transfer.test_p2p_engines import MAX_TOKENS, disaggregate, pair
from tests.tiny_models import random_prompt

pytestmark = pytest.mark.skipif(shm_problem() is not None, reason=str(shm_problem()))

SEGMENT = "memfd:pagedkv-p2p"


def mapped_segments(pid: int) -> int:
    """Shared-memory segments process ``pid`` maps now."""
    return Path(f"/proc/{pid}/maps").read_text().count(SEGMENT)


# ---------------------------------------------------------------------------- the ring
@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(64, 1024),
    steps=st.lists(st.tuples(st.booleans(), st.integers(1, 600)), max_size=80),
)
def test_the_ring_delivers_every_message_once_in_order_intact(capacity, steps) -> None:
    """A producer and a consumer over one ring, interleaved at random: each published message
    is peeked whole and in order; live messages never overlap; a reserve is refused only when
    the room is taken."""
    region = torch.zeros(ring_bytes(capacity), dtype=torch.uint8)
    producer, consumer = ShmRing(region), ShmRing(region)
    live: list[tuple[int, int, int]] = []  # (seq, start, size) published, not released
    seq = 0
    for produce, size in steps:
        if produce:
            if -(-size // 64) * 64 > capacity:  # never fits: an error, not a wait
                with pytest.raises(ValueError, match="does not fit"):
                    producer.reserve(size)
                continue
            room = producer.reserve(size)
            if room is None:  # refused only while older messages hold the room
                assert live
                continue
            start = room.data_ptr() - region.data_ptr() - ring_bytes(0)
            assert all(start + size <= s or s + n <= start for _, s, n in live)  # no overlap
            room.fill_(seq % 251)
            assert producer.publish(seq % 1000) == seq
            live.append((seq, start, size))
            seq += 1
        elif live:
            tag, data = consumer.peek()
            oldest, _, size_ = live.pop(0)
            assert tag == oldest % 1000 and data.numel() == size_
            assert bool((data == oldest % 251).all())
            consumer.release()
            assert producer.consumed(oldest)
        else:
            assert consumer.peek() is None
        assert len(live) <= NUM_SLOTS


def test_a_message_larger_than_the_ring_is_an_error_not_a_wait() -> None:
    ring = ShmRing(torch.zeros(ring_bytes(128), dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not fit"):
        ring.reserve(129)


# ---------------------------------------------------------------------------- the segment
ATTACH = """
import sys
from pagedkv.kv_transfer.p2p.shm_segment import SegmentAddress, ShmSegment, ShmUnavailable
try:
    segment = ShmSegment.attach(SegmentAddress.decode(sys.argv[1].encode()))
except ShmUnavailable as e:
    print("refused:", e)
else:
    print("read:", bytes(segment.ring(0).data[:5].numpy()).decode())
"""


def attach_from_another_process(address: SegmentAddress) -> str:
    argv = [sys.executable, "-c", ATTACH, address.encode().decode()]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()


def test_the_segment_is_unnamed_owner_only_and_only_the_peer_with_its_nonce_maps_it() -> None:
    segment, address, fd = ShmSegment.create(ring_capacity=4096)
    try:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        assert not [name for name in os.listdir("/dev/shm") if "pagedkv" in name]
        segment.ring(0).data[:5] = torch.frombuffer(bytearray(b"hello"), dtype=torch.uint8)
        assert attach_from_another_process(address) == "read: hello"
        forged = SegmentAddress(address.pid, address.fd, "00" * 16, address.ring_capacity)
        assert attach_from_another_process(forged).startswith("refused: the segment at")
        gone = SegmentAddress(address.pid, 999_999, address.nonce, address.ring_capacity)
        assert attach_from_another_process(gone).startswith("refused: can't open")
        with pytest.raises(ShmUnavailable, match="malformed"):
            SegmentAddress.decode(b"1:2:3")
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- engines
def test_1p1d_goes_over_shared_memory_and_p_killed_mid_write_leaves_nothing_on_d(
    start_engine, reference_outputs
) -> None:
    """P is SIGKILLed right after publishing its first message of a 6-block transfer: D's lane
    learns it from P's pidfd at once (not at a timeout), no block of that load is received
    (recompute: D computes the prompt and answers exactly), and D unmaps the segment."""
    p, d = pair(
        start_engine,
        p_extra={"send_type": "PUT"},
        d_extra={"kv_load_failure_policy": "recompute", "kv_load_timeout": 20.0},
        p_hook="die_mid_transfer",
    )
    prompt = random_prompt(100, seed=31)
    p.wait_ready()  # their boots are not the transfer's time
    d.wait_ready()
    t0 = time.monotonic()
    (out,) = disaggregate(p, d, [prompt])
    assert time.monotonic() - t0 < 10  # not the 20 s load deadline, nor 30 s transfer timeout
    assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
    stats = d.wait_settled()["connector"]
    assert stats["num_loads_failed"] == 1 and stats["num_blocks_received"] == 0
    assert stats["num_pair_groups_torn_down_broken"] == 1
    assert "the peer process" in d.log() and "exited" in d.log()
    assert mapped_segments(d.process.pid) == 0


def test_d_killed_mid_receive_fails_ps_send_frees_its_blocks_and_unmaps(start_engine) -> None:
    p, d = pair(start_engine, d_hook="die_mid_receive")
    prompt = random_prompt(100, seed=32)
    p.wait_ready()
    d.wait_ready()
    tid = uuid.uuid4().hex
    d.add("r", prompt, {"do_remote_prefill": True, "transfer_id": tid, **p.kv_address})
    p.add("r", prompt, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    d.process.join(timeout=20)
    assert not d.process.is_alive()
    p.wait(["r"])
    stats = p.wait_settled(timeout_s=20)["connector"]  # settled: P holds no block
    assert stats["num_sends_failed"] == 1 and stats["num_sends_delivered"] == 0
    assert stats["pair_groups"] == 0 and mapped_segments(p.process.pid) == 0


def test_a_peer_on_another_boot_falls_back_to_gloo_visibly(start_engine, reference_outputs):
    p, d = pair(start_engine, d_hook="boot_id:another-boot")
    prompts = [random_prompt(n, seed=33 + n) for n in (20, 70)]
    outs = disaggregate(p, d, prompts)
    assert [o["token_ids"] for o in outs] == reference_outputs("llama", prompts, MAX_TOKENS)
    stats = d.wait_settled()
    assert stats["kv_paths"] == {"P-0": "gloo (not shm: another host (boot ids differ))"}
    assert stats["connector"]["num_shm_fallbacks"] == 1
    assert stats["connector"]["pair_groups_shm"] == 0
    assert mapped_segments(d.process.pid) == 0 == mapped_segments(p.process.pid)


def test_network_on_either_side_keeps_the_pair_on_gloo(start_engine, reference_outputs):
    p, d = pair(start_engine, p_extra={"same_host_transport": "network"})
    prompts = [random_prompt(50, seed=34)]
    outs = disaggregate(p, d, prompts)
    assert [o["token_ids"] for o in outs] == reference_outputs("llama", prompts, MAX_TOKENS)
    assert d.wait_settled()["kv_paths"] == {
        "P-0": "gloo (not shm: the peer: same_host_transport is network)"
    }
    assert p.wait_settled()["kv_paths"] == {"D-0": "gloo"}  # P did not want shared memory


def test_d_plans_chunks_over_shared_memory_and_run_aligned_messages_over_gloo() -> None:
    """Over gloo D cuts its messages where its block ids break (long runs land in place);
    over shared memory every message is copied out of the ring anyway: plain chunks."""
    from types import SimpleNamespace

    from pagedkv.kv_transfer.p2p.inbound import InboundTransfers

    owner = SimpleNamespace(chunk_blocks=4, min_run_blocks=2)
    ids = [10, 11, 12, 20, 30, 31, 32, 33, 34]  # runs of 3, 1 and 5 blocks
    spec = SimpleNamespace(block_indices=[list(range(len(ids)))], block_ids=[ids])
    assert InboundTransfers._plan(owner, spec, in_chunks=True) == [[4, 4, 1]]
    over_gloo = InboundTransfers._plan(owner, spec, in_chunks=False)[0]
    assert sum(over_gloo) == len(ids) and over_gloo != [4, 4, 1]
    assert over_gloo[0] == 3  # the first run is a message of its own
