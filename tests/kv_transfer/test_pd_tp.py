"""PD between engines of different tensor-parallel sizes (separate processes, each rank of an
instance a P2P peer of its own): greedy outputs equal a single instance's, each D rank loading
its KV heads from the P ranks that hold them."""

from __future__ import annotations

import pytest

from tests.kv_transfer.engine_host import p2p_config
from tests.kv_transfer.test_p2p_engines import MAX_TOKENS, changes, disaggregate
from tests.ports import free_port_range
from tests.tiny_models import random_prompt


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)], ids=["P-TP2-D-TP1", "P-TP1-D-TP2"])
def test_pd_between_tensor_parallel_sizes_equals_a_single_instance(
    start_engine, reference_outputs, p_tp: int, d_tp: int
) -> None:
    """The tiny llama's two KV heads: TP2 -> TP1 gathers D's heads from both P ranks, TP1 ->
    TP2 sends each D rank its head from P's one rank; D computes only the last prompt token."""
    p = start_engine(
        "P",
        kv_transfer_config=p2p_config("kv_producer", "P-0", port=free_port_range(p_tp)),
        tensor_parallel_size=p_tp,
    )
    d = start_engine(
        "D",
        kv_transfer_config=p2p_config("kv_consumer", "D-0", port=free_port_range(d_tp)),
        tensor_parallel_size=d_tp,
    )
    prompts = [random_prompt(n, seed=700 + n) for n in (7, 16, 45)]
    p.wait_ready()
    d.wait_ready()
    before_p, before_d = p.wait_settled()["connector"], d.wait_settled()["connector"]
    outs = disaggregate(p, d, prompts, {"remote_tp_size": d_tp}, remote_tp_size=p_tp)
    assert [o["error"] for o in outs] == [None] * len(prompts)
    assert [o["token_ids"] for o in outs] == reference_outputs("llama", prompts, MAX_TOKENS)
    pieces = max(p_tp, d_tp) // d_tp  # D rank 0's loads: one per P rank it takes heads from
    assert changes(d, before_d)["num_loads_delivered"] == len(prompts) * pieces
    assert changes(p, before_p)["num_sends_delivered"] == len(prompts) * (d_tp // p_tp or 1)
