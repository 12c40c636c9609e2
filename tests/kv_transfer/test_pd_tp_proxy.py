"""1P1D through ``pagedkv proxy`` between instances of different tensor-parallel sizes: each
registers its size, the proxy hands each side the other's (``remote_tp_size``), and the answers
equal a single instance's; both instances end with every block free."""

from __future__ import annotations

import pytest

from tests.kv_transfer.conftest import MAX_TOKENS, Cluster, complete, wait_all_blocks_free
from tests.ports import free_port_range
from tests.tiny_models import random_prompt


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)], ids=["P-TP2-D-TP1", "P-TP1-D-TP2"])
def test_1p1d_through_the_proxy_between_tp_sizes(
    tiny_model, tmp_path_factory, reference_text, p_tp: int, d_tp: int
) -> None:
    cluster = Cluster(tiny_model, tmp_path_factory.mktemp(f"pd-tp-{p_tp}-{d_tp}"))
    try:
        proxy = cluster.proxy()
        p, _ = cluster.serve(
            "P", "kv_producer", proxy, "-tp", str(p_tp), kv_port=free_port_range(p_tp)
        )
        d, _ = cluster.serve(
            "D", "kv_consumer", proxy, "-tp", str(d_tp), kv_port=free_port_range(d_tp)
        )
        cluster.ready(p, d)
        proxy.wait_for_instances(1, 1)
        live = proxy.instances()
        sizes = [i["tensor_parallel_size"] for i in live["prefill"] + live["decode"]]
        assert sizes == [p_tp, d_tp]
        prompts = [random_prompt(n, seed=900 + n) for n in (9, 33, 70)]
        client = proxy.client()
        texts = [complete(client, prompt, stream=i == 1) for i, prompt in enumerate(prompts)]
        assert texts == reference_text(prompts, MAX_TOKENS)
        assert d.metrics()["pagedkv:prompt_tokens_total"] == len(prompts)
        wait_all_blocks_free({"P": p, "D": d})
    finally:
        cluster.close()
