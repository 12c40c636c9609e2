"""Concurrent clients are batched; a client that goes away has its request aborted and freed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.conftest import MODEL_NAME, Server, serve
from tests.tiny_models import CONFIGS, build_checkpoint, build_tokenizer

#: A stream this long takes seconds on the tiny model (about 1 ms per token alone), so the
#: client's disconnect always lands before it ends; the shared tiny model stops at 256 positions.
LONG_STREAM_TOKENS = 3000

NUM_CLIENTS = 32
NEW_TOKENS = 16


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_concurrent_requests_are_batched(server: Server) -> None:
    prompts = [f"w{3 + i} w{40 + i} w{90 + i}" for i in range(NUM_CLIENTS)]
    client = server.client()
    alone = client.completions.create(
        model=MODEL_NAME, prompt=prompts[5], max_tokens=NEW_TOKENS, temperature=0
    )

    async def run() -> list:
        async with server.async_client() as aclient:
            return await asyncio.gather(
                *(
                    aclient.completions.create(
                        model=MODEL_NAME,
                        prompt=prompt,
                        max_tokens=NEW_TOKENS,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for prompt in prompts
                )
            )

    before = server.metrics()
    outputs = asyncio.run(run())
    after = server.metrics()

    assert all(len(o.choices[0].text.split()) == NEW_TOKENS for o in outputs)
    assert len({o.id for o in outputs}) == NUM_CLIENTS
    # Batched greedy decoding gives what the request gets alone.
    assert outputs[5].choices[0].text == alone.choices[0].text
    steps = delta(after, before, "pagedkv:engine_steps_total")
    tokens = delta(after, before, "pagedkv:generation_tokens_total")
    assert tokens == NUM_CLIENTS * NEW_TOKENS
    assert tokens / steps > 2, "concurrent requests should share engine steps"
    assert delta(after, before, "pagedkv:batched_steps_total") > 0
    assert after["pagedkv:max_batch_size"] > 1
    assert delta(after, before, "pagedkv:request_success_total{finished_reason=length}") == 32
    assert delta(after, before, "pagedkv:time_to_first_token_seconds_count") == NUM_CLIENTS
    assert delta(after, before, "pagedkv:e2e_request_latency_seconds_count") == NUM_CLIENTS
    itl_count = delta(after, before, "pagedkv:inter_token_latency_seconds_count")
    assert itl_count == NUM_CLIENTS * (NEW_TOKENS - 1)
    assert after["pagedkv:num_requests_running"] == after["pagedkv:num_requests_waiting"] == 0


ABORTED = "pagedkv:request_success_total{finished_reason=abort}"


@pytest.fixture(scope="module")
def long_context_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny Llama, with its word-level tokenizer, with room for ``LONG_STREAM_TOKENS``."""
    config = CONFIGS["llama"]()
    config.max_position_embeddings = 4096
    directory = tmp_path_factory.mktemp("tiny-llama-4k")
    build_checkpoint(directory, config)
    build_tokenizer(directory, config.vocab_size)
    yield from serve(tmp_path_factory, str(directory))


def test_disconnect_mid_stream_aborts_and_frees_blocks(long_context_server: Server) -> None:
    server = long_context_server
    before = server.metrics()
    stream = server.client().completions.create(
        model=MODEL_NAME,
        prompt=[3 + i for i in range(40)],
        max_tokens=LONG_STREAM_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    assert next(chunks).choices[0].text
    during = server.metrics()
    assert during["pagedkv:num_requests_running"] == 1
    assert during["pagedkv:kv_cache_usage_perc"] > 0
    stream.close()

    after = server.wait_for_metrics(lambda m: delta(m, before, ABORTED) == 1)
    assert delta(after, before, ABORTED) == 1
    assert after["pagedkv:num_requests_running"] == 0
    assert after["pagedkv:kv_cache_usage_perc"] == 0
    assert delta(after, before, "pagedkv:generation_tokens_total") < LONG_STREAM_TOKENS
    server.assert_alive()


def test_disconnect_while_waiting_for_a_full_response_aborts(server: Server) -> None:
    before = server.metrics()
    with pytest.raises(httpx.TimeoutException):  # the client gives up before the answer
        server.post(
            "/v1/completions",
            json={"prompt": "w1 w2", "max_tokens": 250, "ignore_eos": True},
            timeout=httpx.Timeout(10, read=0.02),
        )
    after = server.wait_for_metrics(lambda m: delta(m, before, ABORTED) == 1)
    assert delta(after, before, ABORTED) == 1
    assert after["pagedkv:num_requests_running"] == 0
    assert after["pagedkv:kv_cache_usage_perc"] == 0


def test_requests_sharing_an_x_request_id_are_served_apart(server: Server) -> None:
    """Clients may reuse an X-Request-Id: each request is answered under that id as if alone,
    and one that goes away mid-stream does not abort the others (it once did, or was refused)."""
    client = server.client()
    greedy = dict(model=MODEL_NAME, temperature=0, extra_body={"ignore_eos": True})
    shared = {"X-Request-Id": "shared-id"}
    alone = client.completions.create(prompt="w7 w8 w9", max_tokens=100, **greedy)
    before = server.metrics()

    leaving = client.completions.create(
        prompt=[3 + i for i in range(40)], max_tokens=200, stream=True, extra_headers=shared,
        **greedy,
    )  # fmt: skip
    staying = client.completions.create(
        prompt="w7 w8 w9", max_tokens=100, stream=True, extra_headers=shared, **greedy
    )
    leaving_chunks, staying_chunks = iter(leaving), iter(staying)
    first = next(staying_chunks)
    assert next(leaving_chunks).id == first.id == "cmpl-shared-id"
    # A third one under the same id while both run.
    full = client.completions.create(
        prompt="w7 w8 w9", max_tokens=100, extra_headers=shared, **greedy
    )
    assert full.id == "cmpl-shared-id" and full.choices[0].text == alone.choices[0].text
    leaving.close()

    chunks = [first, *staying_chunks]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == alone.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    after = server.wait_for_metrics(lambda m: delta(m, before, ABORTED) == 1)
    assert delta(after, before, ABORTED) == 1  # the one that left, only
    assert delta(after, before, "pagedkv:request_success_total{finished_reason=length}") == 2
