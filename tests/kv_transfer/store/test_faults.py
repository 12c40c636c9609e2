"""Store faults are cache misses: outputs stay exact, requests finish, instances keep serving."""

from __future__ import annotations

import threading
import time

import pytest

from pagedkv import SamplingParams
from pagedkv.engine.request_input import RequestInput
from pagedkv.kv_transfer.store.block_codec import block_key, decode_value, head_key, head_keys
from tests.kv_transfer.store.conftest import backend_for, store_kv_config
from tests.kv_transfer.store.test_store_connector import GREEDY, run, token_ids
from tests.tiny_models import random_prompt


def block_keys(llm, prompt: list[int], group_id: int = 0) -> list[str]:
    """Store keys of the prompt's full blocks (one KV cache group)."""
    engine = llm.llm_engine
    fingerprint = engine.description.identity.fingerprint
    return [block_key(fingerprint, group_id, h) for h in engine.block_hasher.hash_token_ids(prompt)]


def connector_halves(llm):
    engine = llm.llm_engine
    return engine.scheduler.connector, engine.model_runner.kv_connector


def _flip_last_byte(values: dict, key: str, other: str) -> bytes:
    value = bytearray(values[key])
    value[-1] ^= 0xFF
    return bytes(value)


TAMPER = {
    "flipped payload byte": _flip_last_byte,
    "truncated": lambda values, key, other: bytes(values[key])[: len(values[key]) // 2],
    "another key's value": lambda values, key, other: bytes(values[other]),
    "garbage": lambda values, key, other: b"not a kv block",
}


@pytest.mark.parametrize(
    ("store_url", "tamper"),
    [(store, tamper) for store in ("redis", "file") for tamper in sorted(TAMPER)]
    # Mooncake: the corrupt value was just read (a read lease) and must still be replaced.
    + [("mooncake", "flipped payload byte"), ("mooncake", "truncated")],
    indirect=["store_url"],
)
def test_a_corrupted_value_is_detected_and_recomputed(tamper, store_url, make_llm):
    prompt = random_prompt(70, seed=21)
    (expected,) = make_llm("llama").generate([prompt], GREEDY, use_tqdm=False)
    config = store_kv_config(store_url, "kv_both")
    a, b = (
        make_llm("llama", kv_transfer_config=config),
        make_llm("llama", kv_transfer_config=config),
    )
    a.generate([prompt], GREEDY, use_tqdm=False)
    # The value of KV head 1 of block 2 is damaged (head 0's is intact).
    keys = [head_key(key, 1) for key in block_keys(a, prompt)]
    store = backend_for(store_url)
    values = dict(zip(keys, store.get_many(keys)))
    store.put_many([(keys[2], TAMPER[tamper](values, keys[2], keys[1]))])

    (out,) = b.generate([prompt], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    _, worker = connector_halves(b)
    assert worker.stats.num_load_corrupt == 1
    assert worker.stats.num_blocks_loaded == 3  # blocks 0, 1 and 3
    # Blocks 0-1 loaded; from block 2 on B computed the prompt itself ...
    assert b.llm_engine.get_stats().num_prompt_tokens == 70 - 32
    # ... and stored block 2 again, intact.
    (value,) = store.get_many([keys[2]])
    decode_value(keys[2], value, worker.layouts[0].payload_size)
    store.close()


@pytest.mark.parametrize(
    ("store_url", "load_mode"),
    [("redis", "async"), ("redis", "sync"), ("file", "async"), ("file", "sync")]
    + [("mooncake", "async")],
    indirect=["store_url"],
)
def test_a_key_evicted_between_exists_and_get_is_a_miss(load_mode, store_url, make_llm):
    prompt = random_prompt(70, seed=22)
    (expected,) = make_llm("llama").generate([prompt], GREEDY, use_tqdm=False)
    a = make_llm("llama", kv_transfer_config=store_kv_config(store_url, "kv_producer"))
    b = make_llm(
        "llama", kv_transfer_config=store_kv_config(store_url, "kv_consumer", load_mode=load_mode)
    )
    a.generate([prompt], GREEDY, use_tqdm=False)
    evicted = head_key(block_keys(a, prompt)[1], 0)  # one KV head of block 1
    store = backend_for(store_url)
    scheduler_half, worker = connector_halves(b)
    exists_all = scheduler_half.backend.exists_all

    def exists_then_evict(key_sets):
        found = exists_all(key_sets)
        store.delete_many([evicted])
        return found

    scheduler_half.backend.exists_all = exists_then_evict
    (out,) = b.generate([prompt], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert worker.stats.num_load_missing == 1
    # Block 0 loaded; B computed from block 1 on (sync: plus the 6-token step it redid).
    redone = 6 if load_mode == "sync" else 0
    assert b.llm_engine.get_stats().num_prompt_tokens == 70 - 16 + redone
    store.close()


def a_stored_prompts_b_shares(make_llm, config: dict, stored: list[list[int]]):
    """A reference engine, and kv_both instances A and B sharing a store, after A ran
    ``stored``."""
    reference = make_llm("llama")
    a, b = (
        make_llm("llama", kv_transfer_config=config),
        make_llm("llama", kv_transfer_config=config),
    )
    a.generate(stored, GREEDY, use_tqdm=False)
    return reference, b


def b_stores_again_and_c_reuses(make_llm, config: dict, reference, b, seed: int) -> None:
    """The store is back, empty: B (whose store calls failed a moment ago) stores a new
    prompt's blocks as soon as its store lets it, and a new instance C reuses them."""
    prompt = random_prompt(40, seed=seed)
    (want,) = token_ids(reference.generate([prompt], GREEDY, use_tqdm=False))
    _, worker = connector_halves(b)
    puts_before = worker.stats.num_blocks_put
    deadline = time.monotonic() + 30
    while worker.stats.num_blocks_put == puts_before:
        assert time.monotonic() < deadline, "B never stored to the restarted store"
        b.llm_engine.reset_prefix_cache()
        assert token_ids(b.generate([prompt], GREEDY, use_tqdm=False)) == [want]
        time.sleep(0.2)
    c = make_llm("llama", kv_transfer_config=config)
    assert token_ids(c.generate([prompt], GREEDY, use_tqdm=False)) == [want]
    assert c.llm_engine.get_stats().num_prompt_tokens == 40 - 32


def test_redis_killed_mid_run_then_restarted(redis_server, make_llm):
    stored = [random_prompt(60, seed=s) for s in (31, 32, 33)]
    fresh = [random_prompt(45, seed=s) for s in (34, 35)]
    config = store_kv_config(redis_server.url, "kv_both")
    reference, b = a_stored_prompts_b_shares(make_llm, config, stored)
    expected = token_ids(reference.generate(stored + fresh, GREEDY, use_tqdm=False))

    # B finds `stored` in the store, then Redis dies before B's loader fetches anything.
    scheduler_half, worker = connector_halves(b)
    get_into = worker.backend.get_into

    def die_then_get(keys, rows):
        redis_server.stop()
        return get_into(keys, rows)

    worker.backend.get_into = die_then_get
    outs = b.generate(stored + fresh, GREEDY, use_tqdm=False)
    worker.backend.get_into = get_into
    assert token_ids(outs) == expected
    assert scheduler_half.stats.num_hit_blocks == 3 * 3
    assert worker.stats.num_load_errors == 3 * 3 and worker.stats.num_blocks_loaded == 0
    assert b.llm_engine.get_stats().num_prompt_tokens == 3 * 60 + 2 * 45

    # Still serving with the store down: everything is computed locally.
    prompt = random_prompt(40, seed=36)
    (want,) = token_ids(reference.generate([prompt], GREEDY, use_tqdm=False))
    assert token_ids(b.generate([prompt], GREEDY, use_tqdm=False)) == [want]
    assert worker.stats.num_put_failures > 0

    # Redis is back (empty): once the circuit breaker lets calls through, B stores again.
    redis_server.start()
    b_stores_again_and_c_reuses(make_llm, config, reference, b, seed=37)


def test_a_blocked_store_never_stalls_a_step(redis_server, make_llm):
    """The writer is stuck in put_from: puts beyond the bounded queue are dropped, steps go on."""
    config = store_kv_config(redis_server.url, "kv_both", put_queue_mb=0.01, flush_timeout_s=0.3)
    llm = make_llm("llama", kv_transfer_config=config)
    prompts = [random_prompt(70, seed=s) for s in range(40, 46)]
    expected = token_ids(make_llm("llama").generate(prompts, GREEDY, use_tqdm=False))
    _, worker = connector_halves(llm)
    release = threading.Event()
    entered = threading.Event()
    put_from = worker.backend.put_from

    def blocked_put_from(keys, rows):
        entered.set()
        release.wait(timeout=30)
        put_from(keys, rows)

    worker.backend.put_from = blocked_put_from
    try:
        engine = llm.llm_engine
        run(engine, [(random_prompt(20, seed=39), GREEDY, None)])  # one block: the writer sticks
        assert entered.wait(timeout=10)
        ids = [engine.add_request(RequestInput(p, GREEDY)) for p in prompts]
        done, step_times = {}, []
        deadline = time.monotonic() + 60
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline
            t0 = time.perf_counter()
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            step_times.append(time.perf_counter() - t0)
        assert not release.is_set()  # the writer was stuck the whole time
        assert token_ids([done[i] for i in ids]) == expected
        assert max(step_times) < 1.0
        assert worker.stats.num_puts_dropped >= len(prompts) * 4
    finally:
        release.set()


def test_redis_lru_eviction_bounds_memory_and_evicted_blocks_are_misses(make_llm):
    """redis-server with maxmemory + allkeys-lru: the store stays bounded, and the blocks it
    evicted are recomputed by the instance that looks for them."""
    from tests.kv_transfer.store.conftest import RedisServer, require_redis_server
    from tests.ports import free_port

    require_redis_server()
    server = RedisServer(free_port(), "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    server.start()
    try:
        prompts = [random_prompt(70, seed=100 + i) for i in range(60)]  # 240 blocks, ~2 MiB
        first = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        expected = token_ids(make_llm("llama").generate(prompts, first, use_tqdm=False))
        a = make_llm("llama", kv_transfer_config=store_kv_config(server.url, "kv_producer"))
        # A consumer only: its own writes would evict A's blocks before it looks them up.
        b = make_llm("llama", kv_transfer_config=store_kv_config(server.url, "kv_consumer"))
        a.generate(prompts, first, use_tqdm=False)
        info = server.client().info()
        # Bounded: ~2 MiB (Redis counts some buffers outside maxmemory).
        assert info["evicted_keys"] > 0 and info["used_memory"] < 2.5 * 1024 * 1024
        assert token_ids(b.generate(prompts, first, use_tqdm=False)) == expected
        scheduler_half, worker = connector_halves(b)
        hits = scheduler_half.stats.num_hit_blocks
        assert 0 < hits < len(prompts) * 4, (scheduler_half.stats, worker.stats, info)
    finally:
        server.stop()


def test_bad_store_config_fails_at_startup_with_a_clear_error(make_llm):
    with pytest.raises(ValueError, match="needs kv_connector_extra_config.store_url"):
        make_llm(
            "llama",
            kv_transfer_config={"kv_connector": "StoreConnector", "kv_role": "kv_both"},
        )
    with pytest.raises(ValueError, match="kv_connector_extra_config.store_url: Port"):
        make_llm("llama", kv_transfer_config=store_kv_config("redis://h:abc/0", "kv_both"))


def test_an_unexpected_client_exception_is_a_miss_not_a_crash(redis_server, make_llm):
    """Whatever the Redis client raises on the engine thread (lookup) or the writer (puts) is a
    store error: the request is computed locally and the instance keeps serving."""
    prompt = random_prompt(70, seed=23)
    (expected,) = token_ids(make_llm("llama").generate([prompt], GREEDY, use_tqdm=False))
    llm = make_llm("llama", kv_transfer_config=store_kv_config(redis_server.url, "kv_both"))
    scheduler_half, worker = connector_halves(llm)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the client")

    for backend in (scheduler_half.backend, worker.backend):
        backend._get_client().pipeline = broken
    assert token_ids(llm.generate([prompt], GREEDY, use_tqdm=False)) == [expected]
    assert scheduler_half.stats.num_lookup_errors == 1
    assert worker.stats.num_put_failures == 4 and worker.stats.num_blocks_put == 0


@pytest.mark.parametrize("ending", ["abort", "deadline"])
def test_a_load_stuck_in_the_store_ends_by_abort_or_deadline(ending, redis_server, make_llm):
    prompt = random_prompt(70, seed=50)
    (expected,) = token_ids(make_llm("llama").generate([prompt], GREEDY, use_tqdm=False))
    a = make_llm("llama", kv_transfer_config=store_kv_config(redis_server.url, "kv_producer"))
    config = store_kv_config(redis_server.url, "kv_consumer")
    config["kv_load_timeout"] = 0.3
    b = make_llm("llama", kv_transfer_config=config)
    a.generate([prompt], GREEDY, use_tqdm=False)
    _, worker = connector_halves(b)
    get_into = worker.backend.get_into
    fetching, release = threading.Event(), threading.Event()

    def stuck_get_into(keys, rows):
        fetching.set()
        release.wait(30)  # stands in for a slow store; a real one is bounded by timeout_s
        return get_into(keys, rows)

    worker.backend.get_into = stuck_get_into
    engine = b.llm_engine
    rid = engine.add_request(RequestInput(prompt, GREEDY))
    engine.step()  # admitted: the load's deadline is at most 0.3 s from now
    load_deadline = time.monotonic() + 0.3
    assert fetching.wait(timeout=10)
    if ending == "abort":
        engine.abort_request(rid)
        assert engine.kv_cache_manager.usage > 0  # held: the fetch may still land
        release.set()
    outs = {}
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        past_load_deadline = time.monotonic() > load_deadline
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
        if past_load_deadline:  # that step cancelled the overdue load: the fetch may end
            release.set()
    assert worker.stats.num_load_cancelled == 4 and worker.stats.num_blocks_loaded == 0
    if ending == "deadline":  # the load failed at its deadline: recomputed, output exact
        assert outs[rid].outputs[0].token_ids == expected
        assert engine.get_stats().num_prompt_tokens == 70


def test_a_preempted_request_holds_its_blocks_until_its_earlier_puts_end(redis_server, make_llm):
    """`long` queues puts, is preempted, comes back with its blocks hit in the local prefix
    cache and finishes without queueing another: it still holds its blocks until the puts
    queued before the preemption ended, so when the engine is done, its KV is in the store."""
    short, long = random_prompt(10, seed=60), random_prompt(47, seed=61)
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),  # 1 block, never full
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),  # 3 blocks, then a 4th
    ]
    expected = token_ids(make_llm("llama").generate([short, long], params, use_tqdm=False))
    # 4 usable blocks: `long` is preempted when it needs its 4th, back when `short` is done.
    config = store_kv_config(redis_server.url, "kv_producer")
    producer = make_llm(
        "llama", num_gpu_blocks_override=5, max_model_len=64, kv_transfer_config=config
    )
    _, worker = connector_halves(producer)
    put_from = worker.backend.put_from

    def slow_put_from(keys, rows):
        time.sleep(0.3)
        put_from(keys, rows)

    worker.backend.put_from = slow_put_from
    outs = run(producer.llm_engine, [(short, params[0], None), (long, params[1], None)])
    assert token_ids(outs) == expected
    assert producer.llm_engine.get_stats().num_preemptions == 1
    keys = block_keys(producer, long + expected[1][:-1])  # the 3 full blocks it computed
    store = backend_for(redis_server.url)
    heads = connector_halves(producer)[0].heads
    assert store.exists_all([head_keys([key], heads) for key in keys]) == [True] * 3
    store.close()
    # A consumer loads the prompt's 2 full blocks and computes the rest.
    consumer = make_llm(
        "llama", kv_transfer_config=store_kv_config(redis_server.url, "kv_consumer")
    )
    (out,) = consumer.generate([long], params[1], use_tqdm=False)
    assert out.outputs[0].token_ids == expected[1]
    assert consumer.llm_engine.get_stats().num_prompt_tokens == 47 - 32


def test_skipped_puts_are_counted_by_the_thread_that_skips_them(redis_server, make_llm):
    """Each counter has one writer thread: the engine thread counts blocks it knows it stored
    recently, the writer those it finds in the store; /metrics shows both."""
    prompt = random_prompt(70, seed=24)  # with 8 new tokens: 4 full blocks computed
    config = store_kv_config(redis_server.url, "kv_producer")
    a, b = (
        make_llm("llama", kv_transfer_config=config),
        make_llm("llama", kv_transfer_config=config),
    )
    a.generate([prompt], GREEDY, use_tqdm=False)
    a.llm_engine.reset_prefix_cache()
    a.generate([prompt], GREEDY, use_tqdm=False)  # A computes it again: stored recently
    b.generate([prompt], GREEDY, use_tqdm=False)  # B finds A's blocks in the store
    (_, a_worker), (_, b_worker) = connector_halves(a), connector_halves(b)
    assert (a_worker.stats.num_puts_skipped_recent, a_worker.stats.num_puts_skipped_stored) == (
        4,
        0,
    )
    assert (b_worker.stats.num_puts_skipped_recent, b_worker.stats.num_puts_skipped_stored) == (
        0,
        4,
    )
    assert b_worker.stats.num_blocks_put == 0
    exported = a_worker.get_kv_connector_stats()
    assert exported["num_puts_skipped_recent"] == 4 and exported["num_puts_skipped_stored"] == 0
