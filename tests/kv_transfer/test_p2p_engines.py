"""The P2P connector between engines in separate processes (no HTTP): outputs, block
accounting, failure modes and hostile control messages."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest

from tests.kv_transfer.engine_host import EngineHost, p2p_config
from tests.tiny_models import random_prompt

MAX_TOKENS = 8


def disaggregate(
    p: EngineHost,
    d: EngineHost,
    prompts: list[list[int]],
    p_params: dict | None = None,
    **d_params,
) -> list[dict]:
    """Dispatch every prompt to P (max_tokens=1) and D at once, as the proxy does; D's outputs
    (``p_params``, ``d_params``: more kv_transfer_params for P, for D)."""
    p.wait_ready()  # a booting P would eat into D's load deadline
    d.wait_ready()
    ids = []
    for i, prompt in enumerate(prompts):
        tid = uuid.uuid4().hex
        rid = f"r{i}-{tid[:6]}"
        d.add(
            rid,
            prompt,
            {"do_remote_prefill": True, "transfer_id": tid, **p.kv_address, **d_params},
            max_tokens=MAX_TOKENS,
        )
        p.add(
            rid,
            prompt,
            {
                "do_remote_decode": True,
                "transfer_id": tid,
                "remote_engine_id": d.kv_transfer_config["engine_id"],
                **(p_params or {}),
            },
            max_tokens=1,
        )
        ids.append(rid)
    outs = d.wait(ids, timeout_s=60)
    return [outs[rid] for rid in ids]


def pair(start_engine, arch="llama", p_extra=None, d_extra=None, p_hook=None, d_hook=None):
    p = start_engine(
        "P", arch, p_hook, kv_transfer_config=p2p_config("kv_producer", "P-0", **(p_extra or {}))
    )
    d = start_engine(
        "D", arch, d_hook, kv_transfer_config=p2p_config("kv_consumer", "D-0", **(d_extra or {}))
    )
    return p, d


@pytest.fixture(scope="module")
def shared(start_module_engine) -> SimpleNamespace:
    """A P (PUT_ASYNC, 1 s lease) and two Ds (fail / recompute policy, 3 s load deadline) that
    the tests below share; each test looks at the counters' change, not their values."""

    def consumer(policy: str, **extra) -> EngineHost:
        config = p2p_config(
            "kv_consumer",
            f"D-{policy}",
            kv_load_failure_policy=policy,
            kv_load_timeout=3.0,
            **extra,
        )
        return start_module_engine(f"D-{policy}", kv_transfer_config=config)

    p = start_module_engine(
        "P-shared", kv_transfer_config=p2p_config("kv_producer", "P-shared", lease_s=1.0)
    )
    d = {"fail": consumer("fail"), "recompute": consumer("recompute")}
    return SimpleNamespace(p=p, d=d)


TRANSFER_COUNTERS = ("num_loads_", "num_sends_", "num_blocks_", "num_bytes_", "num_tokens_")


def changes(host: EngineHost, before: dict) -> dict[str, int]:
    """How the connector's transfer counters moved since ``before`` (once transfers settled)."""
    after = host.wait_settled()["connector"]
    return {
        k: v - before.get(k, 0)
        for k, v in after.items()
        if k.startswith(TRANSFER_COUNTERS) and v != before.get(k, 0)
    }


def test_a_hybrid_model_disaggregated_equals_a_single_instance_and_frees_every_block(
    start_engine, reference_outputs
) -> None:
    """Full-attention and sliding-window groups (the null block is never sent); the three
    send types with a plain model are covered over HTTP (test_pd_proxy)."""
    p, d = pair(start_engine, "qwen2_hybrid")
    prompts = [random_prompt(n, seed=n) for n in (5, 16, 23, 47, 90)]
    outs = disaggregate(p, d, prompts)
    assert [o["token_ids"] for o in outs] == reference_outputs("qwen2_hybrid", prompts, MAX_TOKENS)
    d_stats, p_stats = d.wait_settled(), p.wait_settled()
    # D computed one prompt token per request (the last, for its logits); the rest arrived.
    assert d_stats["num_prompt_tokens"] == len(prompts)
    assert d_stats["connector"]["num_loads_delivered"] == len(prompts)
    assert p_stats["connector"]["num_sends_delivered"] == len(prompts)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_partial_local_prefix_hit_moves_only_the_missing_blocks(
    shared, reference_outputs, policy
) -> None:
    p, d = shared.p, shared.d[policy]
    shared_prefix = random_prompt(40, seed=7 + (policy == "recompute"))
    # D serves a request on its own first: the first 2 full blocks (32 tokens) get cached.
    d.add("warm", shared_prefix, max_tokens=1)
    d.wait(["warm"])
    before = d.wait_settled()["connector"]
    prompt = shared_prefix[:32] + random_prompt(30, seed=8)  # 62 tokens = 4 blocks, 2 on D
    (out,) = disaggregate(p, d, [prompt])
    assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
    # 2 blocks x 2 layers x (K and V) x 16 tokens x 2 kv heads x 16 head size x 4 bytes
    assert changes(d, before) == {
        "num_loads_delivered": 1,
        "num_blocks_received": 2,
        "num_tokens_received": 30,
        "num_bytes_received": 2 * 2 * 2 * 16 * 2 * 16 * 4,
    }
    p.wait_settled()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_p_dying_mid_transfer_ends_the_load_by_policy(
    start_engine, shared, reference_outputs, policy
) -> None:
    d = shared.d[policy]
    p = start_engine(
        "P-dies",
        hook="die_mid_transfer",
        kv_transfer_config=p2p_config("kv_producer", f"P-dies-{policy}", send_type="PUT"),
    )
    before = d.wait_settled()["connector"]
    prompt = random_prompt(100, seed=9)
    p.wait_ready()  # its boot is not the transfer's time
    t0 = time.monotonic()
    (out,) = disaggregate(p, d, [prompt])
    assert time.monotonic() - t0 < 10  # the broken connection is seen; the deadline is 3 s
    p.process.join(timeout=10)
    assert not p.process.is_alive()
    if policy == "fail":
        assert out["finish_reason"] == "error" and "kv_load_failure_policy=fail" in out["error"]
    else:
        assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
    assert changes(d, before) == {"num_loads_failed": 1}


def test_d_dying_after_its_want_lets_p_free_the_blocks(start_engine, shared) -> None:
    p = shared.p
    d = start_engine(
        "D-dies", hook="die_after_want", kv_transfer_config=p2p_config("kv_consumer", "D-dies")
    )
    before = p.wait_settled()["connector"]
    prompt = random_prompt(50, seed=10)
    tid = uuid.uuid4().hex
    d.add("r", prompt, {"do_remote_prefill": True, "transfer_id": tid, **p.kv_address})
    d.process.join(timeout=15)
    assert not d.process.is_alive()
    p.add("r-dies", prompt, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    p.wait(["r-dies"])
    moved = changes(p, before)  # settled: P holds no block any more
    assert moved.get("num_sends_failed", 0) + moved.get("num_sends_expired", 0) == 1


def test_a_lease_nobody_renews_expires_and_a_late_want_is_refused(shared) -> None:
    p, d = shared.p, shared.d["fail"]
    p_before, d_before = p.wait_settled()["connector"], d.wait_settled()["connector"]
    prompt = random_prompt(50, seed=11)
    tid = uuid.uuid4().hex
    t0 = time.monotonic()
    p.add("r-lease", prompt, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    p.wait(["r-lease"])
    assert changes(p, p_before) == {"num_sends_expired": 1}  # settled: blocks freed
    assert time.monotonic() - t0 >= 1.0  # held for the lease, for a D that never came
    # D turns up late: P NACKs, D's load fails at once and the policy applies.
    d.add("late", prompt, {"do_remote_prefill": True, "transfer_id": tid, **p.kv_address})
    assert d.wait(["late"])["late"]["finish_reason"] == "error"
    assert changes(d, d_before) == {"num_loads_refused": 1}


def test_d_deadline_cancels_and_p_frees_when_its_request_comes_later(shared) -> None:
    p, d = shared.p, shared.d["fail"]
    d_before = d.wait_settled()["connector"]
    prompt = random_prompt(40, seed=12)
    tid = uuid.uuid4().hex
    t0 = time.monotonic()
    d.add("r-deadline", prompt, {"do_remote_prefill": True, "transfer_id": tid, **p.kv_address})
    out = d.wait(["r-deadline"], timeout_s=10)["r-deadline"]
    assert out["finish_reason"] == "error" and 3.0 <= time.monotonic() - t0 < 8
    assert changes(d, d_before) == {"num_loads_failed": 1}
    # P only now gets its request: D's CANCEL already told it nobody wants this KV.
    p.add("r-deadline", prompt, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    p.wait(["r-deadline"])
    p.wait_settled(timeout_s=5)
    assert f"transfer {tid} already ended (failed: cancelled by D" in p.log()


def test_a_full_get_pool_nacks_and_each_policy_applies(
    start_engine, shared, reference_outputs
) -> None:
    p = start_engine(
        "P-get",
        kv_transfer_config=p2p_config("kv_producer", "P-get", send_type="GET", kv_buffer_size=1000),
    )
    prompt = random_prompt(40, seed=13)
    for policy, d in shared.d.items():
        before = d.wait_settled()["connector"]
        (out,) = disaggregate(p, d, [prompt])
        if policy == "fail":
            assert out["finish_reason"] == "error"
        else:
            assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
        assert changes(d, before) == {"num_loads_refused": 1}
    assert p.wait_settled()["connector"]["num_sends_refused"] == 2
    assert "send pool full" in p.log()


def test_a_transfer_id_used_twice_at_once_strands_no_block(start_engine, reference_outputs) -> None:
    """Two live requests with one transfer id (a client talking to P or D directly can send
    that): once, both P's transfer record and the blocks of one were held forever.
    Now the second is refused (P: its KV is not sent; D: its load fails by policy) and the
    first is served. D here has the default load deadline (30 s): the shared D's 3 s, counted
    from D's admission, passed twice in full-suite runs before the shared P held its source.
    P here holds the first for a 5 s lease: with the shared P's 1 s, a loaded machine once let
    the lease end before the second request reached P's scheduler, and nothing conflicted."""
    p = start_engine("P-dup", kv_transfer_config=p2p_config("kv_producer", "P-dup", lease_s=5.0))
    config = p2p_config("kv_consumer", "D-dup", kv_load_failure_policy="fail")
    d = start_engine("D-dup", kv_transfer_config=config)
    prompt = random_prompt(40, seed=14)
    tid = uuid.uuid4().hex
    # P: the first is held for its lease (no D comes), the second is not held at all.
    for rid in ("dup-p1", "dup-p2"):
        p.add(rid, prompt, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    p.wait(["dup-p1", "dup-p2"])
    p.wait_settled(timeout_s=15)
    assert "is already in use by request dup-p1" in p.log()
    # D: the first load gets P's KV, the second fails at once by D's policy.
    tid = uuid.uuid4().hex
    for rid in ("dup-d1", "dup-d2"):
        params = {"do_remote_prefill": True, "transfer_id": tid, **p.kv_address}
        d.add(rid, prompt, params, max_tokens=MAX_TOKENS)
    p.add("dup-src", prompt, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    outs = d.wait(["dup-d1", "dup-d2"])
    assert outs["dup-d1"]["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
    assert outs["dup-d2"]["finish_reason"] == "error"
    assert "already in use by another request" in d.log()
    d.wait_settled()
    p.wait_settled()


# ---------------------------------------------------------------------------- lost messages
def test_lost_and_late_control_messages_end_each_request_and_free_every_block(
    start_engine, shared, reference_outputs
) -> None:
    """D (recompute policy) loses its first WANT, sends its second 0.8 s late (overtaken
    by a heartbeat) and loses the DONE of the third transfer. Each request still gets its
    exact output, and P frees every block in bounded time:
      1. lost WANT: D's next heartbeat names a transfer P never heard of -> NACK -> D
         recomputes; P's KV waits for a WANT that never comes -> freed at its 1 s lease.
      2. late WANT: NACKed as in 1, then the WANT arrives and P sends anyway -> D drains
         the data it no longer wants (never stored) and says so -> P frees at once (before:
         P's send stalled for transfer_timeout_s, 30 s, holding the blocks).
      3. lost DONE: the KV is delivered; P never hears so -> freed at its 1 s lease."""
    p = shared.p
    d = start_engine(
        "D-lossy",
        hook="drop:want@1,delay:want@2:0.8,drop:done@2",
        kv_transfer_config=p2p_config(
            "kv_consumer", "D-lossy", kv_load_failure_policy="recompute", kv_load_timeout=5.0
        ),
    )
    expect = {
        "lost WANT": ({"num_loads_refused": 1}, {"num_sends_expired": 1}),
        "late WANT": ({"num_loads_refused": 1}, {"num_sends_failed": 1}),
        "lost DONE": ({"num_loads_delivered": 1}, {"num_sends_expired": 1}),
    }
    for i, (case, (d_moved, p_moved)) in enumerate(expect.items()):
        prompt = random_prompt(30 + 10 * i, seed=15 + i)
        d_before, p_before = d.wait_settled()["connector"], p.wait_settled()["connector"]
        t0 = time.monotonic()
        (out,) = disaggregate(p, d, [prompt])
        assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0], case
        moved = {k: v for k, v in changes(d, d_before).items() if k.startswith("num_loads")}
        assert moved == d_moved, case
        moved = {k: v for k, v in changes(p, p_before).items() if k.startswith("num_sends")}
        assert moved == p_moved, case  # settled: P holds no block
        assert time.monotonic() - t0 < 8, case  # never P's 30 s transfer timeout


def test_a_lost_xfer_begin_fails_that_transfer_in_bounded_time_and_the_pair_recovers(
    start_engine, shared, reference_outputs
) -> None:
    """P's first XFER_BEGIN is lost: D never posts its receives, so P's send times out (2 s,
    the backstop for a peer that does not answer), P tears the pair group down and says
    goodbye: D recomputes that request and drops its side of the group. The next transfer
    between the two sets up a fresh group and is delivered."""
    d = shared.d["recompute"]
    p = start_engine(
        "P-lossy",
        hook="drop:xfer_begin@1",
        kv_transfer_config=p2p_config("kv_producer", "P-lossy", transfer_timeout_s=2.0),
    )
    d_before = d.wait_settled()["connector"]
    prompts = [random_prompt(40, seed=17), random_prompt(40, seed=18)]
    p.wait_ready()
    t0 = time.monotonic()
    (first,) = disaggregate(p, d, prompts[:1])
    assert time.monotonic() - t0 < 10
    (second,) = disaggregate(p, d, prompts[1:])
    assert [first["token_ids"], second["token_ids"]] == reference_outputs(
        "llama", prompts, MAX_TOKENS
    )
    moved = changes(d, d_before)
    assert moved["num_loads_failed"] == 1 and moved["num_loads_delivered"] == 1, moved
    p_stats = p.wait_settled()["connector"]
    assert p_stats["num_sends_failed"] == 1 and p_stats["num_sends_delivered"] == 1, p_stats
    assert p_stats["num_pair_groups_torn_down_broken"] == 1, p_stats


# ---------------------------------------------------------------------------- silent peers
def test_a_peer_that_never_answers_ends_the_load_at_its_deadline(shared, reference_outputs):
    """Two "P"s that never answer: a ZMQ ROUTER that reads every message and stays silent,
    and a TCP socket that accepts and never speaks (the ZMQ handshake never completes). The
    loads from them end at D's 3 s deadline by each D's policy (fail: an error; recompute:
    the exact output) and both Ds come back to rest."""
    import socket

    import msgspec
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router_port = router.bind_to_random_port("tcp://127.0.0.1")
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen()
    prompt = random_prompt(40, seed=19)
    try:
        started = time.monotonic()
        for policy, port in (("fail", router_port), ("recompute", mute.getsockname()[1])):
            remote = {"remote_host": "127.0.0.1", "remote_port": port,
                      "remote_engine_id": f"silent-{policy}"}  # fmt: skip
            params = {"do_remote_prefill": True, "transfer_id": uuid.uuid4().hex, **remote}
            shared.d[policy].add(f"silent-{policy}", prompt, params, max_tokens=MAX_TOKENS)
        outs = {p: shared.d[p].wait([f"silent-{p}"])[f"silent-{p}"] for p in ("fail", "recompute")}
        assert 3.0 <= time.monotonic() - started < 8
        assert outs["fail"]["finish_reason"] == "error"
        assert outs["recompute"]["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
        kinds = set()
        while router.poll(100):
            _, envelope, *_ = router.recv_multipart()
            kinds.add(msgspec.msgpack.decode(envelope)[2])
        assert {"hello", "want"} <= kinds  # it heard the request, and said nothing
        for d in shared.d.values():
            d.wait_settled()
    finally:
        router.close(linger=0)
        ctx.term()
        mute.close()


def test_a_preemption_storm_on_d_with_loads_in_flight(start_engine, shared, reference_outputs):
    """12 disaggregated requests into a D whose pool holds about three of them: loads wait
    for blocks, running requests are preempted (a loaded request recomputes like any other),
    nothing deadlocks on blocks held by waiting loads; every output is exact and both sides
    come back to rest. How the loads interleave depends on timing: about one round in ten
    preempts nothing, so the storm is repeated (new prompts) until one round has preempted."""
    p = shared.p
    d = start_engine(
        "D-tiny",
        kv_transfer_config=p2p_config("kv_consumer", "D-tiny", kv_load_timeout=20.0),
        num_gpu_blocks_override=12,
        max_model_len=128,
    )
    num_delivered = 0
    for storm in range(4):
        prompts = [random_prompt(44 + i % 4, seed=900 + 12 * storm + i) for i in range(12)]
        outs = disaggregate(p, d, prompts)  # 3 blocks each, a 4th as they decode
        assert [o["token_ids"] for o in outs] == reference_outputs("llama", prompts, MAX_TOKENS)
        stats = d.wait_settled()
        num_delivered += len(prompts)
        assert stats["connector"]["num_loads_delivered"] == num_delivered
        p.wait_settled()
        if stats["num_preemptions"] > 0:
            break
    assert stats["num_preemptions"] > 0, stats


# ---------------------------------------------------------------------------- fuzzed messages
def test_fuzzed_control_messages_into_live_listeners_change_no_transfer(shared, reference_outputs):
    """Hypothesis feeds P's and D's listeners what a buggy peer (or one spoofing made-up
    engine ids) could send: random frames, and random or well-typed structures of every
    message kind under valid envelopes (Hellos, rendezvous keys, WANTs, heartbeats...).
    Both listeners survive, transfers before and after are exact, both come back to rest."""
    import zmq
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from pagedkv.kv_transfer.p2p.protocol import MESSAGE_TYPES
    from pagedkv.transport.codec import Codec
    from tests.kv_transfer.test_fuzz_control_plane import message_frames

    p, d = shared.p, shared.d["recompute"]
    prompts = [random_prompt(36, seed=20), random_prompt(52, seed=21)]
    expected = reference_outputs("llama", prompts, MAX_TOKENS)
    assert disaggregate(p, d, prompts[:1])[0]["token_ids"] == expected[0]
    rejected_before = p.stats()["connector"]["num_rejected_messages"]
    codec = Codec(
        p.stats()["fingerprint"], None, 1 << 20, MESSAGE_TYPES
    )  # no secret on these engines
    ctx = zmq.Context()
    dealers = []
    for host in (p, d):
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{host.kv_transfer_config['kv_port']}")
        dealers.append(dealer)

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(message_frames(codec, MESSAGE_TYPES), min_size=1, max_size=6))
    def fuzz(batch) -> None:
        for frames in batch:
            for dealer in dealers:
                dealer.send_multipart(frames)

    try:
        fuzz()
        assert disaggregate(p, d, prompts[1:])[0]["token_ids"] == expected[1]
    finally:
        for dealer in dealers:
            dealer.close(linger=0)
        ctx.term()
    assert p.stats()["connector"]["num_rejected_messages"] > rejected_before
    for host in (p, d):
        assert host.process.is_alive()
        host.wait_settled()


@pytest.mark.parametrize("send_type", ["PUT", "PUT_ASYNC"])
def test_a_want_arriving_during_ps_forward_joins_it_layer_by_layer(
    start_engine, reference_outputs, send_type
) -> None:
    """D sends its WANT 0.3 s late, so it reaches P while P's forward (0.5 s a layer)
    computes the prompt: the send joins the forward, the layer already written going from the
    paged cache and the other as it is computed, instead of waiting for the request to
    finish."""
    p, d = pair(
        start_engine,
        p_extra={"send_type": send_type},
        p_hook="slow_layers:0.5",
        d_hook="late_want:0.3",
    )
    prompt = random_prompt(60, seed=41)
    (out,) = disaggregate(p, d, [prompt])
    assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
    stats = p.wait_settled()["connector"]
    assert stats["num_joined_sends"] == 1 and stats["num_sends_delivered"] == 1
    assert stats["num_streamed_sends"] == 0 == stats["num_after_forward_sends"]
    assert d.wait_settled()["connector"]["num_tokens_received"] == 60
