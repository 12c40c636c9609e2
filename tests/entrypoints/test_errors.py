"""Bad requests get OpenAI-format errors naming the field, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.entrypoints.conftest import MODEL_NAME, Server

MESSAGES = [{"role": "user", "content": "w9 w10"}]

# (endpoint, request body, the param the error must name)
BAD_REQUESTS = {
    "prompt longer than max_model_len": ("completions", {"prompt": "w3 " * 300}, "prompt"),
    "prompt ids fill max_model_len": ("completions", {"prompt": [3] * 256}, "prompt"),
    "max_tokens 0": ("completions", {"prompt": "w1", "max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ("completions", {"prompt": "w1", "max_tokens": -5}, "max_tokens"),
    "max_completion_tokens 0": (
        "chat/completions",
        {"messages": MESSAGES, "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
    "negative temperature": ("completions", {"prompt": "w1", "temperature": -0.5}, "temperature"),
    "top_p out of range": ("completions", {"prompt": "w1", "top_p": 1.5}, "top_p"),
    "max_tokens wrong type": ("completions", {"prompt": "w1", "max_tokens": "many"}, "max_tokens"),
    "temperature wrong type": ("completions", {"prompt": "w1", "temperature": [1]}, "temperature"),
    "prompt wrong type": ("completions", {"prompt": {"text": "w1"}}, "prompt"),
    "prompt missing": ("completions", {"max_tokens": 3}, "prompt"),
    "stop wrong type": ("completions", {"prompt": "w1", "stop": 5}, "stop"),
    "empty text prompt": ("completions", {"prompt": ""}, "prompt"),
    "empty token prompt": ("completions", {"prompt": []}, "prompt"),
    "n 0": ("completions", {"prompt": "w1", "n": 0}, "n"),
    "n > 1 with kv_transfer_params": (
        "completions",
        {"prompt": "w1", "n": 2, "kv_transfer_params": {"do_remote_decode": True}},
        "n",
    ),
    "best_of other than n": ("completions", {"prompt": "w1", "best_of": 3}, "best_of"),
    "max_tokens beyond the context": (
        "completions",
        {"prompt": "w1 w2", "max_tokens": 255},
        "max_tokens",
    ),
    "max_completion_tokens beyond the context": (
        "chat/completions",
        {"messages": MESSAGES, "max_completion_tokens": 252},
        "max_completion_tokens",
    ),
    "stream_options without stream": (
        "completions",
        {"prompt": "w1", "stream_options": {"include_usage": True}},
        "stream_options",
    ),
    "lone surrogate in the prompt": ("completions", {"prompt": "w1 \ud800"}, "prompt"),
    "lone surrogate in a batch": ("completions", {"prompt": ["w1", "\udfff"]}, "prompt"),
    "lone surrogate in a message": (
        "chat/completions",
        {"messages": [{"role": "user", "content": "w1\ud800"}]},
        "messages",
    ),
    "lone surrogate in stop": ("completions", {"prompt": "w1", "stop": ["\ud800"]}, "stop"),
    "two structured-output fields": (
        "completions",
        {"prompt": "w1", "guided_regex": "a+", "guided_choice": ["a"]},
        "guided_choice",
    ),
    "json_schema without a schema": (
        "chat/completions",
        {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
        "response_format",
    ),
    "structured outputs with two kinds": (
        "completions",
        {"prompt": "w1", "structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
    ),
    "token id above vocab": ("completions", {"prompt": [1, 2, 256]}, "prompt"),
    "negative token id": ("completions", {"prompt": [1, -1]}, "prompt"),
    "batch with an empty prompt": ("completions", {"prompt": ["w1", ""]}, "prompt"),
    "seed beyond 64 bits": ("completions", {"prompt": "w1", "seed": 2**70}, "seed"),
    # Once accepted, then an int64 overflow on the engine thread: the engine died (all 503).
    "top_k beyond int64": ("completions", {"prompt": "w1", "top_k": 2**63}, "top_k"),
    "top_k beyond int32": ("chat/completions", {"messages": MESSAGES, "top_k": 2**31}, "top_k"),
    "stop token id above vocab": (
        "completions",
        {"prompt": "w1", "stop_token_ids": [10**6], "min_tokens": 2},
        "stop_token_ids",
    ),
    "logprobs above 20": ("completions", {"prompt": "w1", "logprobs": 21}, "logprobs"),
    "suffix unsupported": ("completions", {"prompt": "w1", "suffix": "w2"}, "suffix"),
    "no messages": ("chat/completions", {"messages": []}, "messages"),
    "message without role": ("chat/completions", {"messages": [{"content": "w1"}]}, "messages"),
    "top_logprobs without logprobs": (
        "chat/completions",
        {"messages": MESSAGES, "top_logprobs": 2},
        "top_logprobs",
    ),
    "top_logprobs above 20": (
        "chat/completions",
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 30},
        "top_logprobs",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_400_naming_the_field(server: Server, case: str) -> None:
    endpoint, body, param = BAD_REQUESTS[case]
    # json.dumps escapes lone surrogates as JSON allows ("\\ud800"); httpx's json= cannot.
    response = server.post(
        f"/v1/{endpoint}", content=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param, error
    assert error["message"]


def test_bad_request_through_the_openai_client(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="w1", temperature=-1)
    assert info.value.body["param"] == "temperature"
    assert "temperature must be >= 0" in info.value.body["message"]
    server.assert_alive()


def test_unknown_model_is_404_model_not_found(server: Server) -> None:
    """As OpenAI and vLLM answer: 404, code ``model_not_found``, naming the field."""
    with pytest.raises(openai.NotFoundError) as info:
        server.client().completions.create(model="gpt-4", prompt="w1", max_tokens=1)
    body = info.value.body
    assert body["param"] == "model" and body["code"] == "model_not_found"
    assert "gpt-4" in body["message"] and body["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=1)
    server.assert_alive()


def test_malformed_json_is_400(server: Server) -> None:
    response = server.post(
        "/v1/completions",
        content=b'{"prompt": "w1", "max_tokens": ',
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and "JSON" in error["message"]
    not_an_object = server.post("/v1/completions", json=["w1"])
    assert not_an_object.status_code == 400
    server.assert_alive()


def test_kv_transfer_params_that_json_cannot_carry_are_400(server: Server) -> None:
    """Python's parser lets NaN and Infinity in, and the answer echoes kv_transfer_params:
    once a 500 after the request had run (found by tests/kv_transfer/test_pd_faults.py)."""
    for value in (b"Infinity", b"-Infinity", b"NaN"):
        body = b'{"prompt": "w1", "max_tokens": 1, "kv_transfer_params": {"x": [%s]}}' % value
        response = server.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "kv_transfer_params"
    server.assert_alive()


def test_numbers_beyond_the_tensors_range_are_400_or_harmless(server: Server) -> None:
    """1e400 parses as infinity: refused naming the field. Huge finite values are served, or
    refused naming the field where they exceed a limit (max_tokens beyond the context)."""
    for field in ("temperature", "repetition_penalty", "top_p", "presence_penalty"):
        body = b'{"prompt": "w1", "max_tokens": 1, "%s": 1e400}' % field.encode()
        response = server.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field
    for extra in (
        {"temperature": 2**63},
        {"temperature": 1e308, "top_k": 2**31 - 1},
        {"repetition_penalty": 1e308, "seed": 2**64 - 1},
    ):
        response = server.post("/v1/completions", json={"prompt": "w1 w2"} | extra)
        assert response.status_code == 200, (extra, response.text)
    huge = {"prompt": "w1 w2", "max_tokens": 2**70, "min_tokens": 2**69}
    response = server.post("/v1/completions", json=huge)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    server.assert_alive()


def test_body_over_the_limit_is_413(server: Server) -> None:
    huge = b'{"prompt": "' + b"w1 " * (3 << 20) + b'"}'
    response = server.post(
        "/v1/completions", content=huge, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == 413

    def chunked():  # no Content-Length: the limit must hold while reading
        for _ in range(9):
            yield b"w1 " * (1 << 20)

    response = server.post("/v1/completions", content=chunked())
    assert response.status_code == 413
    server.assert_alive()


def test_api_key_is_required_on_v1(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        server.client(api_key="wrong").models.list()
    assert info.value.status_code == 401
    assert info.value.body["type"] == "AuthenticationError"
    for path, body in (("/v1/completions", {"prompt": "w1"}), ("/v1/chat/completions", {})):
        assert httpx.post(f"{server.base_url}{path}", json=body).status_code == 401
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
    # Health checks and scrapes stay open.
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200
    server.assert_alive()


def test_unknown_route_is_openai_format_404(server: Server) -> None:
    response = httpx.get(f"{server.base_url}/v2/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "NotFoundError"


def test_server_still_serves_after_the_errors(server: Server) -> None:
    for endpoint, body, _ in BAD_REQUESTS.values():
        server.post(
            f"/v1/{endpoint}",
            content=json.dumps(body),
            headers={"Content-Type": "application/json"},
        )
    server.assert_alive()
    metrics = server.metrics()
    assert metrics["pagedkv:num_requests_running"] == 0
    assert metrics["pagedkv:kv_cache_usage_perc"] == 0


#: What transformers logs once per tokenizer when a text encodes past its model_max_length.
TOKENIZER_LENGTH_WARNING = "Token indices sequence length is longer than"


def test_over_long_prompt_is_400_without_the_tokenizers_length_warning(builtin_server) -> None:
    """The engine refuses a prompt longer than max_model_len itself: the log must not also
    carry transformers' warning that the sequence "will result in indexing errors". The
    built-in model's tokenizer says model_max_length 256, as real checkpoints' do."""
    from transformers import AutoTokenizer

    from pagedkv.engine.engine_args import DEFAULT_MODEL_PATH

    prompt = "hello " * 300
    plain = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    assert len(plain(prompt, verbose=False)["input_ids"]) > plain.model_max_length == 256
    for create in (
        lambda c: c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1),
        lambda c: c.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=1
        ),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            create(builtin_server.client())
        assert "max_model_len" in info.value.body["message"], info.value.body
    builtin_server.assert_alive()
    assert TOKENIZER_LENGTH_WARNING not in builtin_server.log_path.read_text()
