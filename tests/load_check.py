"""A short bounded-time load against a deployment, and the checks every load test makes:
each request answered exactly once and completely (``run_load``'s ``ok``), and every instance
back at rest afterwards (no request running or waiting, no KV block in use)."""

from __future__ import annotations

import asyncio

from pagedkv.entrypoints.bench.datasets import RequestSampler
from pagedkv.entrypoints.bench.results import RequestResult, format_summary, summarize
from pagedkv.entrypoints.bench.serve import run_load
from pagedkv.entrypoints.bench.settle import wait_settled
from tests.entrypoints.conftest import API_KEY, MODEL_NAME


def short_load(
    base_urls: list[str],
    instance_urls: list[str],
    *,
    seconds: float = 3.0,
    clients: int = 4,
    input_len: int = 40,
    output_len: int = 8,
    settle_timeout_s: float = 20.0,
    dataset: str = "random",
    num_prompts: int = 16,
    seed: int = 0,
) -> tuple[dict, list[RequestResult]]:
    """Run ``clients`` streaming clients for ``seconds`` and check the run; returns the summary
    (printed: ``pytest -s`` shows each deployment's figures) and the results. Request ``i``
    sends prompt ``i % num_prompts`` to base URL ``i % len(base_urls)``."""
    requests = RequestSampler(
        dataset, input_len, output_len, vocab_size=256, seed=seed, prefix_len=32
    ).first(num_prompts)
    results, duration = asyncio.run(
        run_load(
            base_urls,
            MODEL_NAME,
            requests,
            api_key=API_KEY,
            max_concurrency=clients,
            duration=seconds,
            timeout=60,
        )
    )
    summary = summarize(results, duration)
    print(format_summary(summary))
    assert results, "no request completed in the run"
    assert [r.index for r in results] == list(range(len(results)))  # none lost, none twice
    assert len({r.request_id for r in results}) == len(results)
    failed = [(r.request_id, r.error) for r in results if not r.ok]
    assert not failed, failed[:5]
    assert all(r.output_tokens == output_len for r in results)
    assert_at_rest(instance_urls, settle_timeout_s)
    return summary, results


def assert_at_rest(instance_urls: list[str], timeout_s: float = 20.0) -> None:
    states = wait_settled(instance_urls, timeout_s)
    assert all(s.settled for s in states), [s.describe() for s in states]
