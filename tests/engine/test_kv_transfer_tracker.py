"""KVTransferTracker's transitions, driven through its events with a real KVCacheManager and
the in-process test connector's scheduler half (exact block and request state after each)."""

from __future__ import annotations

import time

import pytest

from pagedkv.engine.kv_transfer_tracker import (
    NO_EXTERNAL_TOKENS,
    ExternalTokens,
    KVTransferTracker,
    TransferPhase,
)
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.kv_cache import BlockHasher
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.scheduler_output import SchedulerOutput
from tests.engine.inproc_connector import InProcConnector
from tests.kv_cache.helpers import cached_ids, full_spec, make_manager

BS = 4
LOAD = {"do_remote_prefill": True, "transfer_id": "t"}
SEND = {"do_remote_decode": True, "transfer_id": "t"}
FAILED_LOAD = "loading the KV cache from another instance failed"


class AnsweringConnector(InProcConnector):
    """The in-process connector, answering admissions with a given (tokens, async) pair."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.answer: tuple[int | None, bool] = (0, False)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.answer


def make_tracker(
    role="kv_consumer", policy="fail", timeout=30.0, connector_cls=InProcConnector, clock=None
):
    mgr = make_manager(full_spec(BS), num_blocks=11)
    config = KVTransferConfig(
        "InProcConnector", role, kv_load_failure_policy=policy, kv_load_timeout=timeout
    )
    connector = connector_cls(config, mgr.kv_cache_config, "fp")
    tracker = KVTransferTracker(connector, mgr, **({"clock": clock} if clock else {}))
    return tracker, connector, mgr


def make_request(params: dict | None, num_tokens: int = 10, request_id: str = "r") -> Request:
    return Request(
        request_id,
        list(range(100, 100 + num_tokens)),
        SamplingParams(max_tokens=4),
        max_tokens=4,
        block_hasher=BlockHasher(BS, "xxh3_128"),
        kv_transfer_params=params,
    )


def admit(tracker: KVTransferTracker, request: Request) -> ExternalTokens:
    """A first admission as the scheduler makes it (no local prefix hit)."""
    external = tracker.get_external_tokens(request, 0)
    assert external is not None
    num_new = 0 if external.load_async else request.num_tokens - external.num_tokens
    blocks = tracker.kv_cache_manager.allocate_slots(
        request,
        num_new,
        num_external_computed_tokens=external.num_tokens,
        delay_cache_blocks=external.load_async,
        full_sequence_must_fit=True,
    )
    assert blocks is not None
    tracker.on_allocated(request, external)
    request.num_computed_tokens = external.num_tokens + num_new
    return external


def report(tracker, request, **output):
    return tracker.update_from_output(KVConnectorOutput(**output), [request])


def planned(connector: InProcConnector):
    return connector.build_connector_meta(SchedulerOutput([], [], {}, 0))


def test_a_load_is_loading_then_loaded_then_promoted() -> None:
    tracker, connector, mgr = make_tracker()
    request = make_request(LOAD)
    assert admit(tracker, request) == ExternalTokens(10, True)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert tracker.phase("r") is TransferPhase.LOADING
    assert [load.request_id for load in planned(connector).loads] == ["r"]
    assert not tracker.promote_if_loaded(request)
    assert not cached_ids(mgr)  # a block's KV is cached only once it has landed

    assert report(tracker, request, finished_recving={"r"}) == ([], [])
    assert tracker.phase("r") is TransferPhase.LOADED
    assert tracker.promote_if_loaded(request)
    # The last prompt token is computed locally, for its logits.
    assert (request.status, request.num_computed_tokens) == (RequestStatus.WAITING, 9)
    assert request.num_cached_tokens == 9
    assert cached_ids(mgr) == {1, 2}  # the two full blocks among the 9 loaded tokens
    assert tracker.phase("r") is None and not tracker.holds_blocks


def test_a_load_past_its_deadline_is_cancelled_once() -> None:
    tracker, connector, _ = make_tracker(timeout=0.01)
    request = make_request(LOAD)
    admit(tracker, request)
    planned(connector)
    tracker.cancel_overdue_loads()
    assert planned(connector).cancels == []
    time.sleep(0.02)
    tracker.cancel_overdue_loads()
    tracker.cancel_overdue_loads()
    assert planned(connector).cancels == ["r"]
    assert tracker.phase("r") is TransferPhase.LOADING  # until the connector ends it


def test_a_load_in_progress_at_its_source_counts_its_deadline_from_then() -> None:
    """The connector reports the load in progress (its source is still computing the KV): the
    deadline, 2 s, counts from that report, not from admission; once the reports stop it
    passes as usual, and a load already cancelled stays cancelled."""
    now = [0.0]
    tracker, connector, _ = make_tracker(timeout=2.0, clock=lambda: now[0])
    request, other = make_request(LOAD), make_request(LOAD, request_id="other")
    admit(tracker, request)
    planned(connector)
    now[0] = 1.5
    assert report(tracker, request, loads_in_progress={"r", "unknown"}) == ([], [])
    now[0] = 3.4  # past admission + 2 s, within the report + 2 s
    tracker.cancel_overdue_loads()
    assert planned(connector).cancels == []
    now[0] = 3.6
    tracker.cancel_overdue_loads()
    assert planned(connector).cancels == ["r"]
    report(tracker, request, loads_in_progress={"r"})  # too late: it stays cancelled
    admit(tracker, other)
    now[0] = 5.7
    tracker.cancel_overdue_loads()
    assert planned(connector).cancels == ["other"]
    assert tracker.phase("r") is TransferPhase.LOADING  # until the connector ends it


def test_a_load_whose_blocks_are_bad_fails_under_fail() -> None:
    tracker, _, mgr = make_tracker(policy="fail")
    request = make_request(LOAD)
    admit(tracker, request)
    # Bad blocks may be reported before their load's end: the failure waits for it.
    assert report(tracker, request, invalid_block_ids={2}) == ([], [])
    failed, redo = report(tracker, request, finished_recving={"r"})
    assert [(r.request_id, FAILED_LOAD in why) for r, why in failed] == [("r", True)]
    assert "its blocks did not arrive" in failed[0][1]  # the connector gave no reason
    assert redo == [] and tracker.phase("r") is None
    assert mgr.is_allocated("r")  # the scheduler ends it: request_finished frees
    request.status = RequestStatus.FINISHED_ERROR
    assert tracker.request_finished(request) is None
    assert not mgr.is_allocated("r")


def test_a_failed_load_names_the_connectors_reason() -> None:
    """The client's error says which peer failed and why (a 502 naming them, over HTTP)."""
    tracker, _, _ = make_tracker(policy="fail")
    request = make_request(LOAD)
    admit(tracker, request)
    why = "from P-1 at 127.0.0.1:5000: failed: past kv_load_timeout"
    (failed,), _ = report(
        tracker, request, invalid_block_ids={2}, finished_recving={"r"}, load_errors={"r": why}
    )
    assert why in failed[1] and "kv_load_failure_policy=fail" in failed[1]


def test_a_load_whose_blocks_are_bad_keeps_what_came_before_under_recompute() -> None:
    tracker, _, _ = make_tracker(policy="recompute")
    request = make_request(LOAD)
    admit(tracker, request)
    assert report(tracker, request, invalid_block_ids={2}, finished_recving={"r"}) == ([], [])
    assert tracker.promote_if_loaded(request)
    assert request.num_computed_tokens == BS  # block 2 held tokens 4..7


def test_a_request_ended_while_loading_holds_its_blocks_until_the_load_ends() -> None:
    tracker, connector, mgr = make_tracker()
    request = make_request(LOAD)
    admit(tracker, request)
    planned(connector)
    request.status = RequestStatus.FINISHED_ABORTED
    assert tracker.request_finished(request) is None
    assert planned(connector).cancels == ["r"]
    assert tracker.phase("r") is TransferPhase.ENDED_WHILE_LOADING and tracker.holds_blocks
    assert mgr.is_allocated("r")  # bytes may still land in its blocks
    assert report(tracker, request, finished_recving={"r"}) == ([], [])
    assert not mgr.is_allocated("r") and not tracker.holds_blocks


def test_a_request_ended_after_its_load_ended_frees_at_once() -> None:
    tracker, connector, mgr = make_tracker()
    request = make_request(LOAD)
    admit(tracker, request)
    report(tracker, request, finished_recving={"r"})
    planned(connector)
    request.status = RequestStatus.FINISHED_ABORTED
    tracker.request_finished(request)
    assert planned(connector).cancels == []  # nothing left to cancel
    assert not mgr.is_allocated("r") and tracker.phase("r") is None


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_running_request_that_read_bad_kv(policy) -> None:
    """A synchronous load's blocks reported bad after the step that read them."""
    tracker, connector, mgr = make_tracker(policy=policy, connector_cls=AnsweringConnector)
    connector.answer = (8, False)
    request = make_request(None)
    assert admit(tracker, request) == ExternalTokens(8, False)
    request.status = RequestStatus.RUNNING
    assert cached_ids(mgr) == {1, 2}
    failed, redo = report(tracker, request, invalid_block_ids={2}, finished_recving={"r"})
    assert cached_ids(mgr) == {1}  # block 2 on may not be hit by anyone
    if policy == "fail":
        assert [(r, "kv_load_failure_policy=fail" in why) for r, why in failed] == [(request, True)]
        assert redo == [] and request.num_computed_tokens == 10
    else:
        assert failed == [] and redo == [request]
        assert request.num_computed_tokens == BS
    assert mgr.is_allocated("r")


def test_a_send_holds_the_blocks_until_finished_sending() -> None:
    tracker, _, mgr = make_tracker(role="kv_producer")
    request = make_request(SEND)
    assert admit(tracker, request) == NO_EXTERNAL_TOKENS
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert tracker.request_finished(request) == {"do_remote_prefill": True, "transfer_id": "t"}
    assert tracker.phase("r") is TransferPhase.SENDING and tracker.holds_blocks
    assert report(tracker, request, finished_sending={"r", "unknown"}) == ([], [])
    assert not mgr.is_allocated("r") and not tracker.holds_blocks


def test_the_connectors_admission_answers() -> None:
    tracker, connector, _ = make_tracker(connector_cls=AnsweringConnector)
    request = make_request(None)
    connector.answer = (None, False)
    assert tracker.get_external_tokens(request, 4) is None  # ask again next step
    connector.answer = (10, False)  # a synchronous load never covers the last token
    assert tracker.get_external_tokens(request, 4) == ExternalTokens(5, False)
    connector.answer = (0, True)  # nothing to load is no load
    assert tracker.get_external_tokens(request, 4) == NO_EXTERNAL_TOKENS


def test_without_a_connector_a_finished_request_is_freed_at_once() -> None:
    mgr = make_manager(full_spec(BS), num_blocks=11)
    tracker = KVTransferTracker(None, mgr)
    request = make_request(LOAD)
    assert admit(tracker, request) == NO_EXTERNAL_TOKENS
    assert request.status is RequestStatus.WAITING
    tracker.cancel_overdue_loads()
    request.status = RequestStatus.FINISHED_STOPPED
    assert tracker.request_finished(request) is None
    assert not mgr.is_allocated("r") and not tracker.holds_blocks
