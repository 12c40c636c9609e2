"""D's load deadline under a busy P: while P names a transfer in its heartbeats as still being
computed (its request queued or in prefill), D's deadline for that load counts from the last
time P named it, so an overloaded P costs time, never a failed request; a load P does not
name, or whose P died, still fails at the deadline.

First the owners driven through their events (P's OutboundTransfers, D's InboundTransfers,
the scheduler half's announcements), then engines in separate processes. There P takes
0.25 s more for each step that computes (the ``slow_step`` hook) and runs one request at a
time, so a 16-token request ahead of ours keeps P busy for at least 4 s: twice D's 2 s
``kv_load_timeout``, whatever the machine's speed. The engine tests run in file order and the
last kills P: keep them in this order."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest

from pagedkv.engine.request import Request, RequestStatus
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_transfer.p2p import outbound as outbound_module
from pagedkv.kv_transfer.p2p.connector import P2pConnector, P2pConnectorMetadata, SendSpec
from pagedkv.kv_transfer.p2p.protocol import Heartbeat
from pagedkv.sampling_params import SamplingParams
from pagedkv.transport.peer_addr import PeerAddr
from tests.kv_cache.helpers import full_spec, make_manager
from tests.kv_transfer.engine_host import EngineHost, p2p_config
from tests.kv_transfer.test_p2p_engines import MAX_TOKENS, changes, disaggregate
from tests.kv_transfer.test_p2p_owners import load_spec, run_forward, workers  # noqa: F401
from tests.kv_transfer.test_p2p_units import wait_until
from tests.tiny_models import random_prompt

KV_LOAD_TIMEOUT = 2.0
STEP_S = 0.25
#: Output tokens of the request ahead on P: P is busy for at least this many slow steps.
BLOCKER_TOKENS = 16


# ---------------------------------------------------------------------------- the owners
def test_p_names_to_each_d_the_transfers_it_still_computes_oldest_first_capped(
    workers,  # noqa: F811
    monkeypatch,
) -> None:
    """P names a transfer while its request is here and not ended, and D's WANT is here: not
    for an early WANT (P may never get the request), not after the request departs. At most
    MAX_COMPUTING (2 here) per heartbeat, the oldest first. D hears them and reports its
    loads in progress to the scheduler (the loads only, not the ids P did not name)."""
    monkeypatch.setattr(outbound_module, "MAX_COMPUTING", 2)
    p = workers("kv_producer", name="P")
    d = workers("kv_consumer", name="D")
    for i in range(4):
        d.inbound.on_load(load_spec(f"r{i}", f"t{i}", p, [4 + i], 4))
    wait_until(lambda: p.outbound.num_records == 4)
    assert p.outbound.heartbeats() == {}  # WANTs only: P has none of the requests yet
    arrivals = [("rp3", "t3"), ("rp1", "t1"), ("rp2", "t2"), ("rp-other", "t-no-want")]
    run_forward(p, P2pConnectorMetadata(arrivals=arrivals))
    assert p.outbound.heartbeats() == {d.me: Heartbeat(computing=["t3", "t1"])}
    heard: set[str] = set()
    wait_until(lambda: heard.update(d.get_finished().loads_in_progress) or heard >= {"r3", "r1"})
    run_forward(p, P2pConnectorMetadata(departures=["rp3", "rp1"], releases=["t3"]))
    assert p.outbound.heartbeats() == {d.me: Heartbeat(computing=["t2"])}
    spec = SendSpec("rp2", "t2", 4, "h", ([9],), None)
    run_forward(p, P2pConnectorMetadata(holds=[spec], departures=["rp2"]))
    assert p.outbound.heartbeats() == {}
    wait_until(lambda: "r2" in d.get_finished().finished_recving)
    assert not heard & {"r0", "r2"}  # never named: not in progress


def test_d_counts_a_loads_deadline_from_the_last_time_its_p_named_it(workers) -> None:  # noqa: F811
    """Driven by the test's clock: a load named by its P at t+100 outlives its deadline from
    admission and fails once kv_load_timeout (plus a heartbeat) has passed since then. Only
    its own P can push it forward, and only while no data arrived."""
    p = workers("kv_producer", name="P")
    d = workers("kv_consumer", name="D", kv_load_timeout=KV_LOAD_TIMEOUT)
    limit = KV_LOAD_TIMEOUT + 1.0  # heartbeat_s 0.2: the backstop's slack is 1 s
    t = time.monotonic()
    d.inbound.on_load(load_spec("r1", "t1", p, [4, 5], 8))
    d.inbound.on_peer_busy(p.me, ["t1", "unknown"], t + 100)
    d.inbound.on_peer_busy(PeerAddr("other-P", "127.0.0.1", 9), ["t1"], t + 1000)
    assert d.get_finished().loads_in_progress == {"r1"}
    d.inbound.on_tick(t + 100 + limit - 0.1)
    assert d.inbound.num_loads == 1
    d.inbound.on_tick(t + 100 + limit + 0.1)
    finished = d.get_finished()
    assert finished.finished_recving == {"r1"} and finished.invalid_block_ids == {4, 5}
    assert "kv_load_timeout" in finished.load_errors["r1"]
    wait_until(lambda: p.outbound.ended_reason("t1") is not None)  # P heard the CANCEL
    assert "cancelled by D: no KV within" in p.outbound.ended_reason("t1")


def test_the_scheduler_half_announces_a_prefill_from_arrival_to_its_end() -> None:
    """P's scheduler half: a request whose KV goes to D arrives (named from now on, queued
    or not) and departs when it ends, however it ends; nothing for a request without
    do_remote_decode or with a malformed transfer id."""
    manager = make_manager(full_spec(4), num_blocks=11)
    config = KVTransferConfig("P2pConnector", "kv_producer", kv_port=5)
    connector = P2pConnector(config, manager.kv_cache_config, "fp")

    def request(request_id: str, params: dict | None) -> Request:
        return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=1), max_tokens=1,
                       kv_transfer_params=params)  # fmt: skip

    requests = [
        request("r1", {"do_remote_decode": True, "transfer_id": "t1"}),
        request("plain", None),
        request("bad", {"do_remote_decode": True, "transfer_id": 7}),
    ]
    for r in requests:
        connector.on_new_request(r)
    meta = connector.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[],
        scheduled_cached_reqs=[], num_scheduled_tokens={}))  # fmt: skip
    assert meta.arrivals == [("r1", "t1")] and meta.departures == []
    for r in requests:
        r.status = RequestStatus.FINISHED_ABORTED
        connector.request_finished(r, ([],))
        connector.request_finished(r, ([],))  # a second end announces nothing more
    meta = connector.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[],
        scheduled_cached_reqs=[], num_scheduled_tokens={}))  # fmt: skip
    assert meta.departures == ["r1"] and meta.releases[:1] == ["t1"]


# ---------------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def busy(start_module_engine) -> SimpleNamespace:
    p = start_module_engine(
        "P-busy",
        hook=f"slow_step:{STEP_S}",
        max_num_seqs=1,
        kv_transfer_config=p2p_config("kv_producer", "P-busy", same_host_transport="network"),
    )
    # A long peer timeout and the network path: when P dies, only the load deadline can end
    # D's load in time (over shared memory D sees P's process exit at once: see
    # test_shm_transport.py).
    config = p2p_config(
        "kv_consumer",
        "D-busy",
        kv_load_timeout=KV_LOAD_TIMEOUT,
        kv_load_failure_policy="fail",
        peer_timeout_s=60.0,
    )
    d = start_module_engine("D-busy", kv_transfer_config=config)
    return SimpleNamespace(p=p, d=d)


def hold_busy(p: EngineHost, request_id: str, num_tokens: int = BLOCKER_TOKENS) -> None:
    """A plain request on P ahead of the next ones: P computes nothing else for at least
    ``num_tokens`` slow steps."""
    p.add(request_id, random_prompt(20, seed=33), max_tokens=num_tokens)


def load_only_on_d(p: EngineHost, d: EngineHost, request_id: str) -> None:
    """A load from P whose request P never gets (as if its dispatch to P was lost)."""
    params = {"do_remote_prefill": True, "transfer_id": uuid.uuid4().hex, **p.kv_address}
    d.add(request_id, random_prompt(30, seed=31), params, max_tokens=MAX_TOKENS)


def assert_failed_at_the_deadline(out: dict) -> None:
    assert out["finish_reason"] == "error", out
    assert "kv_load_timeout" in out["error"], out["error"]


def test_a_load_waits_while_p_names_it_and_one_p_does_not_name_fails(
    busy, reference_outputs
) -> None:
    """P is busy 2x D's deadline before it gets to our prompt. The load P names completes
    with a single instance's tokens (before, it failed as a KVTransferError after 2 s); a
    load from the same P that P never heard of fails at the deadline meanwhile."""
    p, d = busy.p, busy.d
    p.wait_ready()
    before = d.wait_settled()["connector"]
    hold_busy(p, "blocker-1")
    load_only_on_d(p, d, "orphan")
    prompt = random_prompt(40, seed=30)
    t0 = time.monotonic()
    (out,) = disaggregate(p, d, [prompt])
    assert out["error"] is None and out["finish_reason"] == "length", out
    assert time.monotonic() - t0 >= BLOCKER_TOKENS * STEP_S  # P was busy that long
    assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
    assert_failed_at_the_deadline(d.wait(["orphan"])["orphan"])
    moved = changes(d, before)
    assert (moved["num_loads_delivered"], moved["num_loads_failed"]) == (1, 1), moved
    p.wait_settled()


def test_p_dying_while_it_names_a_load_fails_it_at_the_deadline(busy) -> None:
    """P names the load, then is killed while it is still busy: D's load fails once
    ``kv_load_timeout`` has passed since P last named it (D would notice P's silence only
    after its 60 s peer timeout), not waiting for ever."""
    p, d = busy.p, busy.d
    before = d.wait_settled()["connector"]
    hold_busy(p, "blocker-2", num_tokens=200)  # 50 s of steps: P dies long before
    tid = uuid.uuid4().hex
    prompt = random_prompt(40, seed=32)
    d.add("named", prompt, {"do_remote_prefill": True, "transfer_id": tid, **p.kv_address},
          max_tokens=MAX_TOKENS)  # fmt: skip
    p.add("named", prompt, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    time.sleep(2 * KV_LOAD_TIMEOUT)  # P named it (else the load had failed by now)
    assert d.call("poll", request_ids=["named"])["named"] is None
    p.kill()
    t_killed = time.monotonic()
    out = d.wait(["named"], timeout_s=30)["named"]
    assert_failed_at_the_deadline(out)
    assert time.monotonic() - t_killed < 30
    assert changes(d, before) == {"num_loads_failed": 1}
