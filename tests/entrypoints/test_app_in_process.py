"""The app factory in-process: two servers side by side, and a dead engine."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from pagedkv import EngineArgs
from pagedkv.engine.async_llm import AsyncLLM
from pagedkv.entrypoints.openai.api_server import build_app
from pagedkv.entrypoints.openai.metrics import PrometheusStatLogger

METRIC_NAMES = (
    "pagedkv:num_requests_running",
    "pagedkv:num_requests_waiting",
    "pagedkv:kv_cache_usage_perc",
    "pagedkv:max_batch_size",
    "pagedkv:prefix_cache_queries_total",
    "pagedkv:prefix_cache_hits_total",
    "pagedkv:num_preemptions_total",
    "pagedkv:prompt_tokens_total",
    "pagedkv:generation_tokens_total",
    "pagedkv:engine_steps_total",
    "pagedkv:batched_steps_total",
    "pagedkv:request_success_total",
    "pagedkv:time_to_first_token_seconds_bucket",
    "pagedkv:inter_token_latency_seconds_bucket",
    "pagedkv:e2e_request_latency_seconds_bucket",
)


def make_server(model: Path, name: str) -> tuple[TestClient, AsyncLLM]:
    registry = CollectorRegistry()
    async_llm = AsyncLLM(
        EngineArgs(model=str(model), max_num_seqs=4), [PrometheusStatLogger(registry, name)]
    )
    return TestClient(build_app(async_llm, name, registry)), async_llm


def test_two_servers_in_one_process_keep_their_own_metrics(tiny_model: Path) -> None:
    (a, engine_a), (b, engine_b) = make_server(tiny_model, "a"), make_server(tiny_model, "b")
    try:
        with a, b:
            response = a.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 3})
            assert response.status_code == 200 and response.json()["model"] == "a"
            a_metrics, b_metrics = a.get("/metrics").text, b.get("/metrics").text
            for name in METRIC_NAMES:
                assert name in a_metrics
            assert 'pagedkv:generation_tokens_total{model_name="a"} 3.0' in a_metrics
            assert 'model_name="a"' not in b_metrics
            assert 'pagedkv:generation_tokens_total{model_name="b"} 0.0' in b_metrics
            assert b.post("/v1/completions", json={"model": "a", "prompt": "w1"}).status_code == 404
    finally:
        engine_a.shutdown()
        engine_b.shutdown()


def test_a_dead_engine_answers_503(tiny_model: Path) -> None:
    client, async_llm = make_server(tiny_model, "dead")
    with client:
        assert client.get("/health").status_code == 200
        async_llm.shutdown()
        assert client.get("/health").status_code == 503
        response = client.post("/v1/completions", json={"prompt": "w1", "max_tokens": 2})
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "ServiceUnavailableError"
