"""Faults over HTTP, on ``pagedkv proxy`` + one P + two D (real ``pagedkv serve`` processes):
garbage ``kv_transfer_params`` sent straight to the instances, a D killed mid-stream, the
proxy killed mid-load. Each request completes correctly or fails with a clear error, nothing
hangs, and the survivors come back to rest (no request running, no KV block in use).

The tests run in file order and each kills part of the cluster: keep them in this order."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.entrypoints.bench.datasets import BenchRequest
from pagedkv.entrypoints.bench.serve import run_load
from tests.entrypoints.conftest import API_KEY, MODEL_NAME, Server
from tests.entrypoints.test_fuzz_api import ANY_JSON
from tests.kv_transfer.conftest import MAX_TOKENS
from tests.load_check import assert_at_rest
from tests.tiny_models import random_prompt


@pytest.fixture(scope="module")
def pd(cluster_factory):
    cluster = cluster_factory()
    proxy = cluster.proxy()
    # A short lease: a P whose D vanished frees within seconds. D-b gives up on a load after
    # 2 s and computes the prompt itself (the fuzz below names peers that never answer).
    p, _ = cluster.serve("P", "kv_producer", proxy, lease_s=3.0)
    d_a, _ = cluster.serve("D-a", "kv_consumer", proxy)
    d_b, _ = cluster.serve(
        "D-b", "kv_consumer", proxy, kv_load_timeout=2.0, kv_load_failure_policy="recompute"
    )
    cluster.ready(p, d_a, d_b)
    proxy.wait_for_instances(1, 2)
    return SimpleNamespace(proxy=proxy, p=p, d_a=d_a, d_b=d_b)


# ---------------------------------------------------------------------------- bad input
HOSTS = st.sampled_from(
    ["127.0.0.1", "localhost", "::1", "[::1]", "foo bar", "*", "", "\x00", "h" * 300, "-x"]
)
KV_TRANSFER_PARAMS = (
    st.fixed_dictionaries(
        {},
        optional={
            "do_remote_prefill": st.booleans() | ANY_JSON,
            "do_remote_decode": st.booleans() | ANY_JSON,
            "transfer_id": st.text(max_size=300) | ANY_JSON,
            "remote_host": HOSTS | st.text(max_size=12) | ANY_JSON,
            "remote_port": st.integers(min_value=-3, max_value=70_000) | ANY_JSON,
            "remote_engine_id": st.text(max_size=12) | ANY_JSON,
            "store_num_tokens": ANY_JSON,
        },
    )
    | ANY_JSON
)


def _post(server: Server, kv_transfer_params, timeout: float = 30) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8] * 5, "max_tokens": 2}
    body["kv_transfer_params"] = kv_transfer_params
    return server.post("/v1/completions", content=json.dumps(body).encode(), timeout=timeout,
                       headers={"Content-Type": "application/json"})  # fmt: skip


def _check(response: httpx.Response) -> None:
    assert response.status_code in (200, 400), (response.status_code, response.text[:300])
    if response.status_code == 400:
        assert response.json()["error"]["message"]


@pytest.mark.parametrize("host", ["foo bar", "*", "\x00", "h" * 300, "a:b"])
def test_a_malformed_remote_host_fails_the_load_by_policy_and_the_instance_lives(pd, host):
    """Once a crash: ZMQ raised on 'a b' inside D's engine step and the engine died."""
    params = {"do_remote_prefill": True, "transfer_id": "t", "remote_host": host,
              "remote_port": 5, "remote_engine_id": "P"}  # fmt: skip
    response = _post(pd.d_b, params)
    assert response.status_code == 200  # D-b's policy: recompute
    assert response.json()["choices"][0]["finish_reason"] == "length"
    pd.d_b.assert_alive()


FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(params=KV_TRANSFER_PARAMS)
def test_fuzzed_kv_transfer_params_into_a_decode_instance(pd, params) -> None:
    _check(_post(pd.d_b, params))


@FUZZ
@given(params=KV_TRANSFER_PARAMS)
def test_fuzzed_kv_transfer_params_into_a_prefill_instance(pd, params) -> None:
    _check(_post(pd.p, params))


def test_the_proxy_replaces_a_clients_kv_transfer_params(pd, reference_text) -> None:
    prompt = random_prompt(30, seed=600)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "kv_transfer_params": {"do_remote_prefill": True,
            "remote_host": "foo bar", "transfer_id": 7}}  # fmt: skip
    response = httpx.post(f"{pd.proxy.base_url}/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == reference_text([prompt], MAX_TOKENS)[0]


def test_instances_are_alive_and_at_rest_after_the_fuzz(pd) -> None:
    for server in (pd.p, pd.d_b):
        server.assert_alive()
    # P held the blocks of fuzzed do_remote_decode requests until their 3 s leases ended.
    assert_at_rest([pd.p.base_url, pd.d_a.base_url, pd.d_b.base_url], timeout_s=20)


# ---------------------------------------------------------------------------- killed processes
def _load(base_url: str, num: int, output_len: int) -> list:
    requests = [BenchRequest(random_prompt(20, seed=700 + i), output_len) for i in range(num)]
    results, _ = asyncio.run(run_load(base_url, MODEL_NAME, requests, api_key=API_KEY, timeout=60))
    return results


def _kill(process) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def _sse_events(lines) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def test_a_decode_killed_mid_stream_ends_its_stream_with_an_error_and_nothing_leaks(pd) -> None:
    """Two long streams through the proxy, one on each D (round robin); D-a is SIGKILLed as
    soon as both have sent their first token. The stream on D-a ends with an error event and
    [DONE] (no hang); the other completes; P and D-b come back to rest; the proxy routes
    around D-a from then on."""
    body = {"model": MODEL_NAME, "prompt": random_prompt(20, seed=650), "max_tokens": 230,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    t0 = time.monotonic()
    client = httpx.Client(base_url=pd.proxy.base_url, headers=headers, timeout=30)
    with (
        client,
        client.stream("POST", "/v1/completions", json=body) as first,
        client.stream("POST", "/v1/completions", json=body) as second,
    ):
        streams = [first.iter_lines(), second.iter_lines()]
        heads = [[next(s)] for s in streams]  # one token each: both Ds are streaming
        _kill(pd.d_a.process)
        events = [_sse_events(head + list(rest)) for head, rest in zip(heads, streams)]
    assert time.monotonic() - t0 < 30
    assert all(e[-1] == "[DONE]" for e in events)
    errors = [e for e in events if any('"error"' in event for event in e)]
    assert len(errors) == 1, events
    assert "failed mid-stream" in json.loads(errors[0][-2])["error"]["message"]
    (complete_stream,) = [e for e in events if e is not errors[0]]
    assert json.loads(complete_stream[-2])["usage"]["completion_tokens"] == 230
    assert_at_rest([pd.p.base_url, pd.d_b.base_url])
    later = _load(pd.proxy.base_url, num=4, output_len=4)  # D-a is retried around, then dropped
    assert all(r.ok for r in later), [r.error for r in later]
    pd.proxy.wait_for_instances(1, 1, timeout_s=10)


def test_the_proxy_killed_mid_load_leaves_instances_serving_and_at_rest(pd) -> None:
    """The proxy is SIGKILLed with three streams decoding and three requests just sent (in
    prefill or transfer). Every client ends at once, with a complete answer or a connection
    error; P and D-b abort what they served for it, P frees KV it held once D cancels (or
    its 3 s lease ends), and both keep serving direct requests."""
    body = {"model": MODEL_NAME, "prompt": random_prompt(20, seed=660), "max_tokens": 230,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    client = httpx.Client(
        base_url=pd.proxy.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    sent: list[str] = []  # how each just-sent request ended
    streamed: list[str] = []  # how each stream ended

    def request(**extra) -> None:
        try:
            response = client.post("/v1/completions", json={**body, **extra})
            sent.append(f"HTTP {response.status_code}")
        except httpx.HTTPError as e:
            sent.append(type(e).__name__)

    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        stack.enter_context(client)
        streams = [
            stack.enter_context(
                client.stream("POST", "/v1/completions", json={**body, "stream": True})
            ).iter_lines()  # fmt: skip
            for _ in range(3)
        ]
        for stream in streams:
            next(stream)  # decoding
        senders = [threading.Thread(target=request, kwargs={"max_tokens": 4}) for _ in range(3)]
        for sender in senders:
            sender.start()
        time.sleep(0.05)
        _kill(pd.proxy.process)
        for stream in streams:
            try:
                events = _sse_events(stream)
                streamed.append("complete" if events[-1:] == ["[DONE]"] else "truncated")
            except httpx.HTTPError as e:
                streamed.append(type(e).__name__)
        for sender in senders:
            sender.join(30)
    assert time.monotonic() - t0 < 30
    clear = {"complete", "HTTP 200", "RemoteProtocolError", "ReadError", "ConnectError"}
    assert len(sent) == len(streamed) == 3 and set(sent + streamed) <= clear, (sent, streamed)
    assert streamed.count("complete") < 3, streamed  # the kill cut the streams short
    assert_at_rest([pd.p.base_url, pd.d_b.base_url])
    pd.d_b.assert_alive()
    pd.p.assert_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{pd.proxy.base_url}/health", timeout=5)
