"""The Mooncake backend against a real ``mooncake_master`` on loopback: its call semantics,
its setup, and each fault as a miss within bounded time (master killed and restarted, the
process holding the blocks killed, the store full)."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from pagedkv.engine.request_input import RequestInput
from pagedkv.kv_transfer.store.backends import StoreError, StoreUnavailable, create_backend
from pagedkv.kv_transfer.store.config import StoreConfig
from tests.kv_transfer.store.conftest import (
    MooncakeMaster,
    MooncakeSegmentHost,
    backend_for,
    store_kv_config,
)
from tests.kv_transfer.store.test_faults import (
    a_stored_prompts_b_shares,
    b_stores_again_and_c_reuses,
    connector_halves,
)
from tests.kv_transfer.store.test_store_connector import GREEDY, token_ids
from tests.tiny_models import random_prompt

#: Clients that lend no memory: the values they put land in another process's segment.
LEND_NOTHING = {"global_segment_size": 0}


def rows_of(*values: bytes, width: int) -> np.ndarray:
    rows = np.zeros((len(values), width), dtype=np.uint8)
    for row, value in zip(rows, values):
        row[: len(value)] = np.frombuffer(value, dtype=np.uint8)
    return rows


def test_put_from_keeps_a_stored_value_put_many_replaces_it_delete_beats_a_lease(
    mooncake_master,
) -> None:
    backend = backend_for(mooncake_master.url)
    try:
        first, second = rows_of(b"1" * 300, width=300), rows_of(b"2" * 300, width=300)
        fetched = np.zeros((2, 300), dtype=np.uint8)
        for buffer in (first, second, fetched):
            backend.register_buffer(buffer)
        backend.put_from(["k"], first)
        backend.put_from(["k"], second)  # equal keys hold equal KV: the stored copy stays
        value, missing = backend.get_into(["k", "missing"], fetched)
        assert bytes(value) == b"1" * 300 and missing is None
        assert np.shares_memory(np.frombuffer(value, dtype=np.uint8), fetched)  # no copy
        backend.put_many([("k", b"replaced")])
        assert backend.get_many(["k", "missing"]) == [b"replaced", None]
        # Read a moment ago, "k" holds a read lease (10 s): it is removed all the same.
        backend.delete_many(["k", "missing"])
        assert backend.exists_many(["k"]) == [False]
    finally:
        backend.close()


def test_a_value_longer_than_its_row_comes_back_whole(mooncake_master) -> None:
    """So that the loader sees a value of the wrong length, discards and deletes it."""
    backend = backend_for(mooncake_master.url)
    try:
        backend.put_many([("long", b"x" * 3000), ("short", b"y" * 10)])
        rows = np.zeros((2, 1000), dtype=np.uint8)
        long, short = backend.get_into(["long", "short"], rows)
        assert bytes(long) == b"x" * 3000 and bytes(short) == b"y" * 10
    finally:
        backend.close()


def test_an_exception_from_the_client_is_a_store_error(mooncake_master) -> None:
    backend = backend_for(mooncake_master.url)
    try:
        with pytest.raises(StoreError, match="mooncake: TypeError"):
            backend.exists_many(["\ud800"])  # no UTF-8 for a lone surrogate: the client raises
        assert not backend.breaker.is_open  # an error, not an unreachable store
    finally:
        backend.close()


def test_no_master_at_startup_costs_no_wait_and_it_connects_once_the_master_starts(
    tmp_path,
) -> None:
    """Mooncake's setup looks for the master ~4.4 s per attempt (20 attempts by default): it
    runs in the background, and calls fail at once until it is done."""
    master = MooncakeMaster(tmp_path / "mooncake_master.log")  # not started yet
    t0 = time.monotonic()
    backend = backend_for(master.url)  # waits connect_timeout_s (1 s) for the setup
    try:
        assert time.monotonic() - t0 < 3
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no client for master"):
            backend.exists_many(["k"])
        assert time.monotonic() - t0 < 0.5
        master.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                assert backend.exists_many(["k"]) == [False]
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "no client 30 s after the master started"
                time.sleep(0.1)
    finally:
        backend.close()
        master.stop()


def test_without_its_client_the_backend_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails
    with pytest.raises(ValueError, match="mooncake-transfer-engine-non-cuda"):
        create_backend(StoreConfig(store_url="mooncake://127.0.0.1:50051"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"store_url": "mooncake://h:abc"}, "store_url: Port"),
        ({"store_url": "mooncake://:50051"}, "needs a host"),
        ({"store_url": "mooncake://h", "ttl_s": 60}, "no per-key TTL"),
        ({"store_url": "mooncake://h", "mooncake": {"segment": 1}}, "unknown .*mooncake option"),
        (
            {"store_url": "mooncake://h", "mooncake": {"global_segment_size": -1}},
            "mooncake.global_segment_size must be a byte count",
        ),
        (
            {"store_url": "mooncake://h", "mooncake": {"global_segment_size": 1 << 20}},
            "at least 16 MiB",
        ),
        ({"store_url": "mooncake://h", "mooncake": {"protocol": ""}}, "mooncake.protocol"),
    ],
)
def test_bad_mooncake_config_is_a_clear_error_at_startup(extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        create_backend(StoreConfig.from_extra_config(extra))


def run_timed(engine, prompts: list[list[int]]) -> tuple[list, float]:
    """Step ``engine`` until its requests for ``prompts`` are done: the outputs, in order, and
    the longest step."""
    ids = [engine.add_request(RequestInput(prompt, GREEDY)) for prompt in prompts]
    done, longest = {}, 0.0
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        t0 = time.perf_counter()
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        longest = max(longest, time.perf_counter() - t0)
    return [done[i] for i in ids], longest


def test_master_killed_costs_no_wait_and_once_restarted_blocks_are_shared_again(
    mooncake_master, make_llm
):
    stored = [random_prompt(60, seed=s) for s in (71, 72, 73)]
    fresh = [random_prompt(45, seed=s) for s in range(74, 90)]
    config = store_kv_config(mooncake_master.url, "kv_both")
    reference, b = a_stored_prompts_b_shares(make_llm, config, stored)
    expected = token_ids(reference.generate(stored + fresh, GREEDY, use_tqdm=False))

    # The master dies. A client call made now would wait ~4.5 s while Mooncake reconnects;
    # B serves request after request for 4 s (past the circuit breaker's first probes), and
    # no step waits on the master.
    mooncake_master.stop()
    scheduler_half, worker = connector_halves(b)
    killed_at, outs, longest = time.monotonic(), [], 0.0
    for i, prompt in enumerate(stored + fresh):
        (out,), step = run_timed(b.llm_engine, [prompt])
        outs.append(out)
        longest = max(longest, step)
        if i >= len(stored) and time.monotonic() - killed_at > 4:
            break
    assert token_ids(outs) == expected[: len(outs)]
    assert longest < 1.5, f"a step took {longest:.2f} s with the master down"
    assert scheduler_half.stats.num_lookup_errors > 0 and scheduler_half.stats.num_hit_blocks == 0
    assert worker.stats.num_put_failures > 0

    # The master is back, empty (metadata lives in its memory): B's client reconnects and
    # remounts its segment, B stores again.
    mooncake_master.start()
    b_stores_again_and_c_reuses(make_llm, config, reference, b, seed=91)


def test_the_process_holding_the_blocks_killed_reads_fail_and_are_recomputed(
    mooncake_master, make_llm, tmp_path
):
    """Its keys still exist for the master (until its client TTL, 10 s), every read of them
    fails at once: B recomputes and never waits."""
    host = MooncakeSegmentHost(mooncake_master, 32 << 20, tmp_path / "segment_host.log")
    try:
        prompts = [random_prompt(70, seed=s) for s in (92, 93)]
        expected = token_ids(make_llm("llama").generate(prompts, GREEDY, use_tqdm=False))
        url = mooncake_master.url
        a = make_llm(
            "llama", kv_transfer_config=store_kv_config(url, "kv_producer", mooncake=LEND_NOTHING)
        )
        b = make_llm(
            "llama", kv_transfer_config=store_kv_config(url, "kv_consumer", mooncake=LEND_NOTHING)
        )
        a.generate(prompts, GREEDY, use_tqdm=False)  # the blocks land in the host's segment
        host.kill()
        outs, longest = run_timed(b.llm_engine, prompts)
        assert token_ids(outs) == expected
        assert longest < 1.5, f"a step took {longest:.2f} s"
        scheduler_half, worker = connector_halves(b)
        assert scheduler_half.stats.num_hit_blocks == 2 * 4  # found, ...
        assert worker.stats.num_load_errors == 2 * 4 and worker.stats.num_blocks_loaded == 0
        assert b.llm_engine.get_stats().num_prompt_tokens == 2 * 70  # ... and recomputed
    finally:
        host.kill()


def fill_and_lease(backend, sizes: tuple[int, ...]) -> int:
    """Put values of each size (largest first) until the store has no room for one more;
    each value is looked up as soon as it is stored, which gives it a read lease (10 s) that
    keeps the master from evicting it. Returns how many were stored."""
    num_stored = 0
    for size in sizes:
        row = np.zeros((1, size), dtype=np.uint8)
        backend.register_buffer(row)
        while True:
            key = f"filler:{num_stored}"
            try:
                backend.put_from([key], row)
            except StoreError as e:
                assert "NO_AVAILABLE_HANDLE" in str(e)
                break
            assert backend.exists_many([key]) == [True]
            num_stored += 1
    return num_stored


def test_a_full_store_drops_puts_and_counts_them(mooncake_master, make_llm):
    prompts = [random_prompt(70, seed=s) for s in (94, 95)]  # 4 full blocks each
    expected = token_ids(make_llm("llama").generate(prompts, GREEDY, use_tqdm=False))
    config = store_kv_config(mooncake_master.url, "kv_both", mooncake=LEND_NOTHING)
    llm = make_llm("llama", kv_transfer_config=config)
    filler = backend_for(mooncake_master.url, mooncake={"global_segment_size": 16 << 20})
    try:
        # The store's only segment (16 MiB, the filler's) is full of values read just now.
        assert fill_and_lease(filler, (1 << 20, 64 << 10, 4 << 10)) >= 16
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        _, worker = connector_halves(llm)
        assert worker.stats.num_put_failures == 2 * 4 and worker.stats.num_blocks_put == 0
    finally:
        filler.close()
