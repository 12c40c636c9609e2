"""Fuzzed request bodies against the real server: every answer is a 200 or a 4xx in OpenAI's
error format, never a 5xx, a crash or a hang, and no request is left holding KV blocks."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.entrypoints.conftest import MODEL_NAME, Server

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
#: Integers beyond int32 / int64 / uint64 and floats beyond float32, or infinite (1e400 and
#: Infinity both parse as inf): values that once passed validation and broke a tensor.
HUGE_INTS = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1]) | st.integers(
    min_value=-(2**80), max_value=2**80
)
HUGE_FLOATS = st.sampled_from([1e39, 1e308, -1e308, 5e-324, math.inf, -math.inf]) | st.floats()
ODD_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
COMMON_FIELDS = {
    "model": st.sampled_from([MODEL_NAME, "gpt-4", ""]) | ANY_JSON,
    "max_tokens": st.integers(min_value=-3, max_value=8) | st.just(10**12) | ANY_JSON,
    "temperature": st.floats(min_value=-2, max_value=3) | ANY_JSON,
    "top_p": st.floats(min_value=-1, max_value=2) | ANY_JSON,
    "top_k": st.integers(min_value=-3, max_value=50) | ANY_JSON,
    "seed": st.integers(min_value=-(2**70), max_value=2**70) | ANY_JSON,
    "stop": ODD_TEXT | st.lists(ODD_TEXT, max_size=3) | ANY_JSON,
    "stop_token_ids": st.lists(st.integers(min_value=-5, max_value=10**6), max_size=3) | ANY_JSON,
    "logprobs": st.integers(min_value=-2, max_value=30) | st.booleans() | ANY_JSON,
    "n": st.integers(min_value=-1, max_value=3) | ANY_JSON,
    "stream": st.booleans() | ANY_JSON,
    "presence_penalty": st.floats(min_value=-5, max_value=5) | ANY_JSON,
    "min_tokens": st.integers(min_value=-2, max_value=9) | ANY_JSON,
    "kv_transfer_params": ANY_JSON,
}
PROMPTS = (
    ODD_TEXT
    | st.lists(st.integers(min_value=-10, max_value=10**9), max_size=12)
    | st.just("")
    | st.just("w1 " * 400)  # longer than max_model_len
    | ANY_JSON
)
MESSAGES = (
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "tool", "nobody"])
                | ANY_JSON,
                "content": ODD_TEXT | ANY_JSON,
            }
        ),
        max_size=3,
    )
    | ANY_JSON
)
#: The numeric fields, each alone in an otherwise valid request (so that most examples reach
#: SamplingParams and the engine).
NUMBER = HUGE_INTS | HUGE_FLOATS | st.integers(min_value=-3, max_value=50) | st.floats(-3, 3)
NUMERIC_FIELDS = {
    name: NUMBER
    for name in (
        "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "n",
        "priority",
    )
} | {"stop_token_ids": st.lists(NUMBER, min_size=1, max_size=2)}  # fmt: skip
COMPLETION_BODIES = st.fixed_dictionaries({}, optional={"prompt": PROMPTS, **COMMON_FIELDS})
CHAT_BODIES = st.fixed_dictionaries({}, optional={"messages": MESSAGES, **COMMON_FIELDS})
FUZZ = settings(
    max_examples=70, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def post_json(server: Server, path: str, body: dict):
    """JSON as Python writes it, NaN and Infinity included (not valid JSON: a 400 too)."""
    return server.post(
        path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )


def check(server: Server, response) -> None:
    # 404: an unknown model (OpenAI's model_not_found).
    assert response.status_code in (200, 400, 404, 413), (response.status_code, response.text[:500])
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["message"] and error["code"] in (response.status_code, "model_not_found")
    # A bad value that reaches the engine thread can kill it after a 200 (or while streaming).
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200, response.text


@FUZZ
@given(body=COMPLETION_BODIES)
def test_fuzzed_completion_bodies(server: Server, body: dict) -> None:
    check(server, post_json(server, "/v1/completions", body))


@FUZZ
@given(body=CHAT_BODIES)
def test_fuzzed_chat_bodies(server: Server, body: dict) -> None:
    check(server, post_json(server, "/v1/chat/completions", body))


@pytest.mark.parametrize("name", sorted(NUMERIC_FIELDS))
@settings(FUZZ, max_examples=25)
@given(data=st.data(), chat=st.booleans(), stream=st.booleans())
def test_fuzzed_numbers_in_valid_requests(
    server: Server, name: str, data: st.DataObject, chat: bool, stream: bool
) -> None:
    """Huge integers (beyond int64) and floats (beyond float32, infinite): a 400 or an answer,
    and the engine keeps running either way (top_k 2**63 once killed it)."""
    body = {"model": MODEL_NAME, "max_tokens": 2, "stream": stream}
    body[name] = data.draw(NUMERIC_FIELDS[name], label=name)
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "w1"}]
    else:
        path, body["prompt"] = "/v1/completions", "w1 w2"
    check(server, post_json(server, path, body))


@FUZZ
@given(raw=st.binary(max_size=200) | ANY_JSON.map(lambda v: json.dumps(v).encode()))
def test_fuzzed_raw_bytes(server: Server, raw: bytes) -> None:
    response = server.post(
        "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
    )
    check(server, response)


def test_server_is_clean_after_fuzzing(server: Server) -> None:
    server.assert_alive()
    metrics = server.wait_for_metrics(
        lambda m: m["pagedkv:num_requests_running"] == 0 and m["pagedkv:kv_cache_usage_perc"] == 0
    )
    assert metrics["pagedkv:num_requests_running"] == 0
    assert metrics["pagedkv:kv_cache_usage_perc"] == 0
