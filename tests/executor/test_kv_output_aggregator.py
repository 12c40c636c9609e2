"""The ranks' KV connector reports as one: a transfer ends once every rank has said so."""

from __future__ import annotations

from pagedkv.executor.kv_output_aggregator import KVOutputAggregator
from pagedkv.kv_connector.output import KVConnectorOutput


def test_a_transfer_ends_in_the_step_its_last_rank_reports_it() -> None:
    aggregator = KVOutputAggregator(2, lambda metas: metas)
    first = aggregator.aggregate(
        [KVConnectorOutput(finished_sending={"a"}, finished_recving={"b"}), None]
    )
    assert first.finished_sending == set() and first.finished_recving == set()
    second = aggregator.aggregate(
        [KVConnectorOutput(), KVConnectorOutput(finished_sending={"a"}, finished_recving={"b"})]
    )
    assert second.finished_sending == {"a"} and second.finished_recving == {"b"}
    third = aggregator.aggregate([KVConnectorOutput(finished_sending={"a"}), None])
    assert third.finished_sending == set()  # a new round for the same id starts over


def test_failures_and_progress_pass_through_at_once() -> None:
    aggregator = KVOutputAggregator(2, lambda metas: metas)
    out = aggregator.aggregate(
        [
            KVConnectorOutput(invalid_block_ids={1}, load_errors={"r": "rank 0's"}),
            KVConnectorOutput(
                invalid_block_ids={2}, load_errors={"r": "rank 1's"}, loads_in_progress={"s"}
            ),
        ]
    )
    assert out.invalid_block_ids == {1, 2} and out.loads_in_progress == {"s"}
    assert out.load_errors == {"r": "rank 0's"}


def test_worker_meta_is_combined_by_the_connectors_rule() -> None:
    aggregator = KVOutputAggregator(2, lambda metas: tuple(metas))
    out = aggregator.aggregate([KVConnectorOutput(worker_meta="m0"), KVConnectorOutput()])
    assert out.worker_meta == ("m0", None)
    assert aggregator.aggregate([KVConnectorOutput(), None]).worker_meta is None
