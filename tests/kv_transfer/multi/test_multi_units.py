"""The MultiConnector's semantics with scripted children: who loads, who holds, what merges."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tests.kv_transfer.multi.scripted_connector as scripted
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_transfer.factory import create_connector
from pagedkv.kv_transfer.multi.config import child_configs
from pagedkv.kv_transfer.multi.connector import MultiConnector
from pagedkv.kv_transfer.multi.worker import MultiConnectorWorker
from pagedkv.transport.peer_addr import PeerAddr


def child(name: str, **script) -> dict:
    return {
        "kv_connector": "ScriptedConnector",
        "kv_connector_extra_config": {"name": name, **script},
    }


def multi_config(*children: dict, **fields) -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": list(children)},
            **fields,
        }
    )


def multi(*children: dict, **fields) -> tuple[MultiConnector, MultiConnectorWorker]:
    scheduler, worker = create_connector(multi_config(*children, **fields), None, "fp")
    assert isinstance(scheduler, MultiConnector) and isinstance(worker, MultiConnectorWorker)
    return scheduler, worker


def request(request_id: str = "r") -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, kv_transfer_params=None)


def calls(method: str) -> list[tuple[str, tuple]]:
    return [(name, args) for name, m, args in scripted.CALLS if m == method]


@pytest.fixture(autouse=True)
def _fresh_calls():
    scripted.CALLS.clear()


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ({}, r"connectors must be a non-empty list"),
        ({"connectors": []}, r"connectors must be a non-empty list"),
        ({"connectors": "P2pConnector"}, r"connectors must be a non-empty list"),
        ({"connectors": [child("a")], "mode": "x"}, r"unknown .*extra_config key\(s\) \['mode'\]"),
        ({"connectors": [child("a"), 3]}, r"connectors\[1\] must be a kv_transfer_config"),
        (
            {"connectors": [{"kv_connector": "MultiConnector", "kv_role": "kv_both"}]},
            r"connectors\[0\]\.kv_connector: a MultiConnector cannot hold another",
        ),
        ({"connectors": [{**child("a"), "kv_port": -1}]}, r"connectors\[0\]: .*kv_port"),
        ({"connectors": [{**child("a"), "colour": 1}]}, r"connectors\[0\]: unknown .*colour"),
    ],
)
def test_a_bad_config_fails_naming_the_field(extra, error) -> None:
    config = KVTransferConfig("MultiConnector", "kv_both", kv_connector_extra_config=extra)
    with pytest.raises(ValueError, match=error):
        child_configs(config)


def test_children_inherit_the_role_id_timeout_and_policy_they_do_not_set() -> None:
    config = multi_config(
        child("a"),
        {**child("b"), "kv_role": "kv_producer", "kv_load_timeout": 99.0},
        kv_role="kv_consumer",
        engine_id="E",
        kv_load_timeout=5.0,
        kv_load_failure_policy="recompute",
    )
    a, b = child_configs(config)
    assert (a.kv_role, a.engine_id, a.kv_load_timeout, a.kv_load_failure_policy) == (
        "kv_consumer",
        "E",
        5.0,
        "recompute",
    )
    assert (b.kv_role, b.engine_id, b.kv_load_timeout) == ("kv_producer", "E", 99.0)


def test_an_unknown_child_connector_is_named() -> None:
    config = multi_config({"kv_connector": "NoSuchConnector"})
    with pytest.raises(ValueError, match="unknown kv_connector 'NoSuchConnector'"):
        create_connector(config, None, "fp")


def test_a_child_that_fails_to_start_stops_those_already_started() -> None:
    with pytest.raises(RuntimeError, match="b failed to start"):
        multi(child("a"), child("b", fail="start"))
    # Both scheduler halves and worker half a were started, then shut down.
    assert [name for name, _ in calls("shutdown")] == ["a", "a", "b"]


# ------------------------------------------------------------------ loads
def test_children_load_one_after_the_other() -> None:
    scheduler, worker = multi(child("a", matched=0), child("b", matched=32), child("c", matched=48))
    assert scheduler.get_num_new_matched_tokens(request(), 16) == (80, True)
    # Each child is asked from where the ones before it stop.
    assert calls("get_num_new_matched_tokens") == [
        ("a", ("r", 16)),
        ("b", ("r", 16)),
        ("c", ("r", 48)),
    ]
    scheduler.update_state_after_alloc(request(), None, 80)
    assert calls("update_state_after_alloc") == [
        ("a", ("r", 0)),
        ("b", ("r", 32)),
        ("c", ("r", 48)),
    ]
    meta = scheduler.build_connector_meta(None)
    assert meta.loaders == {"r": (1, 2)}
    scheduler.cancel_load(request())
    assert calls("cancel_load") == [("b", ("r",)), ("c", ("r",))]
    # The load ends once both loaders have reported it.
    worker.bind_connector_metadata(meta)
    worker.workers[1].pending = KVConnectorOutput(finished_recving={"r"})
    assert worker.get_finished().finished_recving == set()
    worker.workers[2].pending = KVConnectorOutput(finished_recving={"r"})
    assert worker.get_finished().finished_recving == {"r"}


def test_a_synchronous_load_is_a_requests_only_one() -> None:
    scheduler, _ = multi(child("a", matched=32, sync=True), child("b", matched=48))
    assert scheduler.get_num_new_matched_tokens(request(), 0) == (32, False)
    scheduler.update_state_after_alloc(request(), None, 31)  # capped before the last token
    assert calls("update_state_after_alloc") == [("a", ("r", 31)), ("b", ("r", 0))]
    scheduler, _ = multi(child("a", matched=32), child("b", matched=48, sync=True))
    assert scheduler.get_num_new_matched_tokens(request(), 0) == (32, True)


def test_a_child_that_does_not_know_yet_makes_the_multi_ask_again() -> None:
    scheduler, _ = multi(child("a", matched=None), child("b", matched=32))
    assert scheduler.get_num_new_matched_tokens(request(), 0) == (None, False)
    scheduler_b_first, _ = multi(child("b", matched=32), child("a", matched=None))
    assert scheduler_b_first.get_num_new_matched_tokens(request(), 0) == (None, False)


def test_no_child_with_tokens_is_no_load() -> None:
    scheduler, _ = multi(child("a"), child("b"))
    assert scheduler.get_num_new_matched_tokens(request(), 0) == (0, False)
    scheduler.cancel_load(request())
    assert calls("cancel_load") == []


def test_the_loading_children_decide_the_failure_policy_of_their_request() -> None:
    fails = {**child("p2p", matched=16), "kv_load_failure_policy": "fail"}
    caches = {**child("cache", matched=32), "kv_load_failure_policy": "recompute"}
    scheduler, _ = multi(fails, caches)
    p2p_request, cache_request, both, plain = map(request, ("p2p", "cache", "both", "plain"))
    scheduler.get_num_new_matched_tokens(both, 0)
    scheduler.connectors[1].script["matched"] = 0
    scheduler.get_num_new_matched_tokens(p2p_request, 0)
    scheduler.connectors[0].script["matched"] = 0
    scheduler.connectors[1].script["matched"] = 32
    scheduler.get_num_new_matched_tokens(cache_request, 0)
    assert scheduler.load_failure_policy_for(p2p_request) == "fail"
    assert scheduler.load_failure_policy_for(cache_request) == "recompute"
    # Loaded by both: a cache's miss never fails a request.
    assert scheduler.load_failure_policy_for(both) == "recompute"
    # A request no child loads: the MultiConnector's own policy.
    assert scheduler.load_failure_policy_for(plain) == "fail"
    # Once the request ends, its loaders are forgotten.
    scheduler.request_finished(cache_request, ([],))
    assert scheduler.load_failure_policy_for(cache_request) == "fail"


def test_the_load_timeout_is_the_longest_childs() -> None:
    scheduler, _ = multi(
        {**child("a"), "kv_load_timeout": 3.0}, {**child("b"), "kv_load_timeout": 7.5}
    )
    assert scheduler.load_timeout == 7.5


# ------------------------------------------------------------------ endings
def test_params_merge_key_by_key_and_an_earlier_child_wins() -> None:
    scheduler, _ = multi(
        child("a", params={"do_remote_prefill": True, "transfer_id": "t"}),
        child("b"),
        child("c", params={"do_remote_prefill": False, "store_num_tokens": 32}),
    )
    assert scheduler.request_finished(request(), ([1, 2],)) == (
        False,
        {"do_remote_prefill": True, "transfer_id": "t", "store_num_tokens": 32},
    )


def step(scheduler: MultiConnector, worker: MultiConnectorWorker, **outputs) -> KVConnectorOutput:
    """One step down and up; ``outputs``: what each child's worker half reports (by name)."""
    worker.bind_connector_metadata(scheduler.build_connector_meta(None))
    worker.start_load_kv()
    for child_worker in worker.workers:
        child_worker.pending = outputs.get(child_worker.name, KVConnectorOutput())
    output = worker.get_finished()
    worker.clear_connector_metadata()
    scheduler.update_connector_output(output)
    return output


def test_a_request_two_children_hold_is_sent_once_both_have_sent() -> None:
    scheduler, worker = multi(child("a", hold=True), child("b", hold=True), child("c"))
    assert scheduler.request_finished(request(), ([1],))[0] is True
    sent = KVConnectorOutput(finished_sending={"r"})
    assert step(scheduler, worker, a=sent).finished_sending == set()
    assert step(scheduler, worker, b=sent).finished_sending == {"r"}
    # A request only one child holds: reported when that child reports it.
    scheduler.connectors[1].script["hold"] = False
    assert scheduler.request_finished(request("s"), ([2],))[0] is True
    assert step(
        scheduler, worker, a=KVConnectorOutput(finished_sending={"s"})
    ).finished_sending == {"s"}


@given(order=st.permutations(range(3)), reports=st.lists(st.integers(0, 2), max_size=6))
def test_a_held_request_is_reported_exactly_once_after_its_last_holder(order, reports) -> None:
    """Whatever the order in which children report (and a non-holder's stray report), the
    request is reported once, in the step its last holder reports it."""
    scheduler, worker = multi(child("a", hold=True), child("b", hold=True), child("c"))
    try:
        scheduler.request_finished(request(), ([1],))
        holders = {"a", "b"}
        reported = []
        for position in [*reports, *order]:
            name = "abc"[position]
            out = step(scheduler, worker, **{name: KVConnectorOutput(finished_sending={"r"})})
            holders.discard(name)
            reported.append(bool(out.finished_sending))
            if out.finished_sending:
                assert not holders
                break
        assert reported.count(True) == 1
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_outputs_merge_and_each_child_gets_its_own_worker_meta_back() -> None:
    scheduler, worker = multi(child("a"), child("b"))
    out = step(
        scheduler,
        worker,
        a=KVConnectorOutput(
            finished_recving={"x"}, invalid_block_ids={3}, load_errors={"x": "a's"}
        ),
        b=KVConnectorOutput(
            finished_recving={"y"},
            loads_in_progress={"z"},
            load_errors={"x": "b's", "y": "b's"},
            worker_meta={"stored": [1]},
        ),
    )
    assert out.finished_recving == {"x", "y"} and out.invalid_block_ids == {3}
    assert out.loads_in_progress == {"z"}
    assert out.load_errors == {"x": "a's", "y": "b's"}
    assert out.worker_meta == (None, {"stored": [1]})
    a, b = scheduler.connectors
    assert a.outputs[-1].worker_meta is None and b.outputs[-1].worker_meta == {"stored": [1]}
    assert b.outputs[-1].finished_recving == {"x", "y"}
    # Nothing to report: no worker_meta at all (the output is empty).
    assert step(scheduler, worker).is_empty


def test_each_child_worker_gets_its_own_metadata_and_every_hook() -> None:
    scheduler, worker = multi(child("a"), child("b"))
    worker.bind_connector_metadata(scheduler.build_connector_meta(None))
    worker.start_load_kv()
    worker.wait_for_layer_load(0)
    worker.save_kv_layer(0, None, None)
    worker.wait_for_save()
    assert [(w.bound[-1].name, w.bound[-1].step) for w in worker.workers] == [("a", 1), ("b", 1)]
    hooks = [(n, m) for n, m, _ in scripted.CALLS if m != "get_num_new_matched_tokens"]
    assert hooks == [
        (n, m)
        for m in ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save")
        for n in "ab"
    ]
    scheduler.on_new_request(request())
    assert [name for name, _ in calls("on_new_request")] == ["a", "b"]


# ------------------------------------------------------------------ stats, events, address
def test_stats_are_prefixed_per_child_and_counters_stay_counters() -> None:
    stats = {"num_sends_delivered": 2, "send_pool_used_bytes": 10, "num_p2p_x": 1}
    scheduler, worker = multi(
        {**child("a", stats=stats)},
        child("b", stats={"num_lookups": 4}),
        child("c", stats={"num_lookups": 5}),
    )
    expected = {
        "num_scripted_sends_delivered": 2,
        "scripted_send_pool_used_bytes": 10,
        "num_scripted_p2p_x": 1,
        "num_scripted_2_lookups": 4,
        "num_scripted_3_lookups": 5,
    }
    assert scheduler.get_kv_connector_stats() == expected
    assert worker.get_kv_connector_stats() == expected


def test_a_name_already_under_the_prefix_is_kept() -> None:
    scheduler, _ = multi(child("a", stats={"num_scripted_hits": 1, "scripted_used_bytes": 2}))
    assert scheduler.get_kv_connector_stats() == {"num_scripted_hits": 1, "scripted_used_bytes": 2}


def test_events_are_the_childrens_in_order_and_the_peer_is_the_first_known() -> None:
    scheduler, _ = multi(
        child("a", events=["a1", "a2"]),
        child("b", peer=["B", "127.0.0.1", 5000]),
        child("c", events=["c1"], peer=["C", "127.0.0.1", 5001]),
    )
    assert scheduler.take_events() == ["a1", "a2", "c1"]
    assert scheduler.take_events() == []
    assert scheduler.peer_address == PeerAddr("B", "127.0.0.1", 5000)
    assert multi(child("a"))[0].peer_address is None


# ------------------------------------------------------------------ shutdown, progress
def test_shutdown_reaches_every_child_even_when_one_raises() -> None:
    scheduler, worker = multi(child("a", fail="shutdown"), child("b"), child("c", fail="shutdown"))
    for half in (scheduler, worker):
        scripted.CALLS.clear()
        with pytest.raises(RuntimeError, match="a failed to shut down"):
            half.shutdown()
        assert [name for name, _ in calls("shutdown")] == ["a", "b", "c"]


def test_any_childs_progress_wakes_the_multi() -> None:
    _, worker = multi(child("a", signals=True), child("b", signals=True))
    assert worker.signals_progress
    assert all(w.progress_event is worker.progress_event for w in worker.workers)
    threading.Timer(0.2, worker.workers[1].notify_progress).start()
    began = time.monotonic()
    worker.wait_for_progress(10.0)
    assert 0.15 < time.monotonic() - began < 5.0
    assert not worker.progress_event.is_set()  # cleared for the next wait


def test_a_child_that_does_not_signal_makes_the_multi_poll() -> None:
    _, worker = multi(child("a", signals=True), child("b"))
    assert not worker.signals_progress
    began = time.monotonic()
    worker.wait_for_progress(10.0)
    assert time.monotonic() - began < 1.0
