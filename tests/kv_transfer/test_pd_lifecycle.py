"""What a client and an operator see when a KV load fails or an instance shuts down, over
HTTP with real ``pagedkv proxy`` and ``pagedkv serve`` processes.

- A failed load under ``kv_load_failure_policy=fail`` is an error naming the peer and the
  cause (a 502 of type KVTransferError, or an SSE error event), never a 200 with empty text.
- The proxy retries such a failure before the first byte: on another pair, or with
  ``--fallback local`` on a decode instance alone.
- SIGTERM drains: the instance leaves the proxy at once, in-flight requests finish, exit 0.

The tests of this module share one cluster and run in file order (the last one stops it).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME
from tests.kv_transfer.conftest import MAX_TOKENS, complete
from tests.load_check import assert_at_rest
from tests.ports import free_port
from tests.tiny_models import random_prompt

#: D gives up on a load this long after admitting it.
LOAD_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def pd(cluster_factory):
    cluster = cluster_factory()
    proxy = cluster.proxy()
    fallback_proxy = cluster.proxy("--fallback", "local", name="proxy-fallback")
    # Short leases: a P that was stopped frees what it held soon after it resumes.
    p1, _ = cluster.serve("P-1", "kv_producer", proxy, lease_s=3.0)
    p2, _ = cluster.serve("P-2", "kv_producer", proxy, lease_s=3.0)
    d, _ = cluster.serve("D", "kv_consumer", proxy, kv_load_timeout=LOAD_TIMEOUT_S)
    p3, _ = cluster.serve("P-3", "kv_producer", fallback_proxy, lease_s=3.0)
    # D-2 gives up on a silent P after peer_timeout_s (10 s), on a load after a minute: its
    # requests can still be running when it shuts down (after 1 s).
    d2, _ = cluster.serve("D-2", "kv_consumer", fallback_proxy, "--shutdown-timeout", "1",
                          kv_load_timeout=60.0)  # fmt: skip
    cluster.ready(p1, p2, d, p3, d2)
    proxy.wait_for_instances(2, 1)
    fallback_proxy.wait_for_instances(1, 1)
    return SimpleNamespace(
        proxy=proxy, p1=p1, p2=p2, d=d, fallback_proxy=fallback_proxy, p3=p3, d2=d2
    )


def _nowhere() -> dict:
    """kv_transfer_params naming a P that never answers (nothing listens on its port)."""
    return {"do_remote_prefill": True, "transfer_id": f"t-{time.monotonic_ns()}",
            "remote_engine_id": "P-nowhere", "remote_host": "127.0.0.1",
            "remote_port": free_port()}  # fmt: skip


def _body(prompt: list[int], **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip


def test_a_failed_kv_load_is_an_error_naming_the_peer_and_the_cause(pd) -> None:
    """Once a 200 with empty text and finish_reason "error": a client could not tell a
    failure from an empty answer, and the proxy passed it on."""
    body = _body(random_prompt(30, seed=1), kv_transfer_params=_nowhere())
    t0 = time.monotonic()
    response = pd.d.post("/v1/completions", json=body)
    assert LOAD_TIMEOUT_S - 0.5 < time.monotonic() - t0 < 30
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["type"] == "KVTransferError" and error["code"] == 502
    assert "P-nowhere" in error["message"] and "kv_load_timeout" in error["message"]

    body["kv_transfer_params"] = _nowhere()
    url, headers = f"{pd.d.base_url}/v1/completions", {"Authorization": f"Bearer {API_KEY}"}
    body["stream"] = True
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as stream:
        assert stream.status_code == 200
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 2, events  # nothing but the error
    error = json.loads(events[0])["error"]
    assert error["type"] == "KVTransferError" and "P-nowhere" in error["message"]
    assert_at_rest([pd.d.base_url])


def test_the_chat_role_chunk_is_not_sent_before_a_failed_load(pd) -> None:
    """A stream's first event is the first token or the error: a proxy that sees the error
    first can still retry the request elsewhere."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w1 w2 w3"}],
            "max_tokens": 2, "stream": True, "kv_transfer_params": _nowhere()}  # fmt: skip
    url, headers = f"{pd.d.base_url}/v1/chat/completions", {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert len(events) == 2 and json.loads(events[0])["error"]["type"] == "KVTransferError"


def _stopped(server):
    os.kill(server.process.pid, signal.SIGSTOP)
    return server


def _resume(server) -> None:
    os.kill(server.process.pid, signal.SIGCONT)


def test_a_load_that_fails_is_retried_on_another_pair(pd, reference_text) -> None:
    """P-1 hangs (SIGSTOP): each request the proxy pairs with P-1 fails its KV load at D's
    deadline and is retried with P-2, so every client gets the exact answer."""
    prompts = [random_prompt(40, seed=10 + i) for i in range(3)]
    client = pd.proxy.client()
    _stopped(pd.p1)
    try:
        texts = [complete(client, prompt, stream=i % 2 == 1) for i, prompt in enumerate(prompts)]
    finally:
        _resume(pd.p1)
    assert texts == reference_text(prompts, MAX_TOKENS)
    log = pd.proxy.log_path.read_text()
    assert "KV load failed" in log and "P-1" in log  # round robin paired P-1 at least once
    assert_at_rest([pd.p1.base_url, pd.p2.base_url, pd.d.base_url], timeout_s=30)


def test_with_fallback_local_the_decode_instance_prefills_itself(pd, reference_text) -> None:
    """The only P hangs: D gives up on it (peer_timeout_s) and ``--fallback local`` sends the
    request to D alone."""
    prompt = random_prompt(40, seed=30)
    _stopped(pd.p3)
    try:
        texts = [complete(pd.fallback_proxy.client(), prompt, stream=s) for s in (False, True)]
    finally:
        _resume(pd.p3)
    assert texts == reference_text([prompt], MAX_TOKENS) * 2
    assert_at_rest([pd.p3.base_url, pd.d2.base_url], timeout_s=30)


def test_requests_still_running_at_the_shutdown_timeout_end_with_a_clear_error(pd) -> None:
    """D-2 (``--shutdown-timeout 1``) holds two requests waiting for KV that will not come.
    SIGTERM: a second later both end with a 503 saying why (the stream with an error event
    and [DONE]), their loads are cancelled, and D-2 exits 0."""
    url, headers = f"{pd.d2.base_url}/v1/completions", {"Authorization": f"Bearer {API_KEY}"}
    answers: list = []

    def request() -> None:
        body = _body(random_prompt(30, seed=50), kv_transfer_params=_nowhere())
        answers.append(httpx.post(url, json=body, headers=headers, timeout=60))

    waiter = threading.Thread(target=request)
    waiter.start()
    body = _body(random_prompt(30, seed=51), kv_transfer_params=_nowhere(), stream=True)
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as stream:
        pd.d2.wait_for_metrics(lambda m: m["pagedkv:num_requests_waiting"] == 2)
        pd.d2.process.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    waiter.join(30)
    assert time.monotonic() - t0 < 15
    assert events[-1] == "[DONE]" and len(events) == 2, events
    assert "shutting down" in json.loads(events[0])["error"]["message"]
    (answer,) = answers
    assert answer.status_code == 503 and "--shutdown-timeout" in answer.json()["error"]["message"]
    assert pd.d2.process.wait(timeout=30) == 0
    assert "shut down" in pd.d2.log_path.read_text()


def test_sigterm_drains_deregisters_at_once_and_exits_0(pd, reference_text) -> None:
    """Once: uvicorn re-raised SIGTERM after its own shutdown, so D exited 143 without
    deregistering (the proxy kept it ~6 s, until its heartbeats timed out) and without
    stopping its connector. Now D leaves ``/instances`` at once while its in-flight stream
    finishes exactly, and P and both proxies exit 0 on SIGTERM too."""
    prompt = random_prompt(20, seed=40)
    body = _body(prompt, max_tokens=120, stream=True)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{pd.proxy.base_url}/v1/completions", json=body,
                      headers=headers, timeout=60) as stream:  # fmt: skip
        lines = stream.iter_lines()
        head = [next(lines)]  # D is decoding
        pd.d.process.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        while pd.proxy.instances()["decode"]:
            assert time.monotonic() - t0 < 3, "D still registered 3 s after SIGTERM"
            time.sleep(0.05)
        events = [line[6:] for line in head + list(lines) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == reference_text([prompt], 120)[0]
    assert pd.d.process.wait(timeout=60) == 0
    for process in (pd.p1.process, pd.p3.process, pd.proxy.process, pd.fallback_proxy.process):
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
