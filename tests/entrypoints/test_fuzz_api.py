"""Fuzzed request bodies against the real server: every answer is a 200 or a 4xx in OpenAI's
error format, never a 5xx, a crash or a hang, and no request is left holding KV blocks."""

from __future__ import annotations

import json

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
COMPLETION_BODIES = st.fixed_dictionaries({}, optional={"prompt": PROMPTS, **COMMON_FIELDS})
CHAT_BODIES = st.fixed_dictionaries({}, optional={"messages": MESSAGES, **COMMON_FIELDS})
FUZZ = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def post_json(server: Server, path: str, body: dict):
    """JSON as Python writes it, NaN and Infinity included (not valid JSON: a 400 too)."""
    return server.post(
        path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )


def check(response) -> None:
    assert response.status_code in (200, 400, 413), (response.status_code, response.text[:500])
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["message"] and error["code"] == response.status_code


@FUZZ
@given(body=COMPLETION_BODIES)
def test_fuzzed_completion_bodies(server: Server, body: dict) -> None:
    check(post_json(server, "/v1/completions", body))


@FUZZ
@given(body=CHAT_BODIES)
def test_fuzzed_chat_bodies(server: Server, body: dict) -> None:
    check(post_json(server, "/v1/chat/completions", body))


@FUZZ
@given(raw=st.binary(max_size=200) | ANY_JSON.map(lambda v: json.dumps(v).encode()))
def test_fuzzed_raw_bytes(server: Server, raw: bytes) -> None:
    check(server.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"}))


def test_server_is_clean_after_fuzzing(server: Server) -> None:
    server.assert_alive()
    metrics = server.wait_for_metrics(
        lambda m: m["pagedkv:num_requests_running"] == 0 and m["pagedkv:kv_cache_usage_perc"] == 0
    )
    assert metrics["pagedkv:num_requests_running"] == 0
    assert metrics["pagedkv:kv_cache_usage_perc"] == 0
