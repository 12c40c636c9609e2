"""What a vLLM user expects of ``pagedkv serve``, through the real ``openai`` client: n > 1,
batched prompts, structured outputs, generation-config defaults, the utility endpoints."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, Server

PROMPT = "w5 w17 w42 w99"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


# ---------------------------------------------------------------- n > 1 and batches
def test_n_choices_streamed_and_not(server: Server) -> None:
    client = server.client()
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, n=3)
    full = client.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert len({c.text for c in full.choices}) == 3
    assert full.usage.prompt_tokens == 4 and full.usage.completion_tokens == 24
    assert [c.text for c in client.completions.create(**kw).choices] == [
        c.text for c in full.choices
    ]  # the same seed, the same n outputs
    texts = {0: "", 1: "", 2: ""}
    chunks = list(client.completions.create(**kw, stream=True))
    for chunk in chunks:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
    assert [texts[i] for i in range(3)] == [c.text for c in full.choices]
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2]


def test_chat_with_n(server: Server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "w9 w10 w11"}]
    kw = dict(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=1.0, seed=4, n=2)
    full = client.chat.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1]
    stream = list(client.chat.completions.create(**kw, stream=True))
    roles = [c.choices[0].index for c in stream if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices[0].index == i)
        assert text == full.choices[i].message.content


def test_batched_prompts_one_choice_each_times_n(server: Server) -> None:
    client = server.client()
    kw = dict(model=MODEL_NAME, max_tokens=5, temperature=0)
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in ("w1 w2", "w7")]
    batch = client.completions.create(prompt=["w1 w2", "w7"], n=2, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert batch.usage.prompt_tokens == 3 and batch.usage.completion_tokens == 20
    by_ids = client.completions.create(prompt=[[1, 2], [7]], **kw)
    assert [c.text for c in by_ids.choices] == alone
    chunks = list(
        client.completions.create(
            prompt=["w1 w2", "w7"], stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    streamed = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert [streamed[0], streamed[1]] == alone
    assert chunks[-1].usage.completion_tokens == 10


def test_a_batch_streamed_to_a_client_that_leaves_is_aborted_whole(server: Server) -> None:
    aborted = "pagedkv:request_success_total{finished_reason=abort}"
    before = server.metrics().get(aborted, 0)
    body = {"prompt": ["w1 w2", "w3"], "n": 2, "max_tokens": 240, "ignore_eos": True}
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        json=body | {"stream": True},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ) as response:
        next(response.iter_lines())  # the first chunk: the requests run
    after = server.wait_for_metrics(lambda m: m.get(aborted, 0) >= before + 2)
    assert after[aborted] == before + 2  # both prompts (n children each) ended as aborted
    assert after["pagedkv:num_requests_running"] == 0
    server.assert_alive()


# ---------------------------------------------------------------- the utility endpoints
def test_tokenize_detokenize_version_ping(server: Server) -> None:
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "w5 w17"}).json()
    assert tokens == {"count": 2, "max_model_len": 256, "tokens": [5, 17], "token_strs": None}
    chat = httpx.post(
        f"{server.base_url}/tokenize",
        json={"messages": [{"role": "user", "content": "w9"}], "return_token_strs": True},
    ).json()
    assert chat["tokens"] == [2, 9, 4, 3] and chat["token_strs"] == ["w2", "w9", "w4", "w3"]
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [5, 17]}).json()
    assert text == {"prompt": "w5 w17"}
    bad = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(f"{server.base_url}/version").json() == {"version": "0.1.0"}
    assert httpx.get(f"{server.base_url}/ping").status_code == 200
    assert httpx.post(f"{server.base_url}/ping").status_code == 200


def test_non_streaming_client_gone_leaves_no_traceback(server: Server) -> None:
    """Regression: after a non-streaming client disconnected, the server logged
    ``InvalidStateError: Result is not set`` (the cancelled task was read before it ended)."""
    before = server.log_path.read_text()
    host, port = server.base_url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "w1 w2", "max_tokens": 200, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.5)
    server.wait_for_metrics(lambda m: m.get("pagedkv:num_requests_running", 1) == 0)
    server.assert_alive()
    new = server.log_path.read_text()[len(before) :]
    assert "Traceback" not in new and "InvalidStateError" not in new, new


# ---------------------------------------------------------------- structured outputs
def test_response_format_json_schema(builtin_server: Server) -> None:
    client = builtin_server.client()
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Describe a user as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "user", "schema": SCHEMA, "strict": True},
        },
        temperature=1.0,
        max_tokens=230,
        n=3,
        seed=5,
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    streamed = client.completions.create(
        model=MODEL_NAME,
        prompt="user = ",
        extra_body={"guided_json": SCHEMA},
        max_tokens=200,
        stream=True,
    )
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in streamed)), SCHEMA)


def test_json_object_was_ignored_and_now_holds(builtin_server: Server) -> None:
    """Regression: ``{"type": "json_object"}`` answered 200 with ``def[self]``. Any object may
    run past max_tokens (its keys and strings are free), so: every choice is an object's text
    so far, and those that ended are whole objects."""
    out = builtin_server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Give me JSON."}],
        response_format={"type": "json_object"},
        max_tokens=200,
        n=4,
        seed=1,
    )
    ended = [c for c in out.choices if c.finish_reason == "stop"]
    assert ended and all(c.message.content.lstrip().startswith("{") for c in out.choices)
    for choice in ended:
        assert isinstance(json.loads(choice.message.content), dict)


def test_vllm_structured_output_extras(builtin_server: Server) -> None:
    client = builtin_server.client()
    kw = dict(model=MODEL_NAME, prompt="answer: ", max_tokens=40)
    choice = client.completions.create(
        **kw, n=4, extra_body={"guided_choice": ["yes", "no", "maybe"]}
    )
    assert {c.text for c in choice.choices} <= {"yes", "no", "maybe"}
    regex = client.completions.create(**kw, extra_body={"guided_regex": r"[A-Z]{3}-\d{2}"})
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", regex.choices[0].text)
    options = {"structured_outputs": {"regex": r"(ab)+c", "disable_any_whitespace": True}}
    assert re.fullmatch(
        r"(ab)+c", client.completions.create(**kw, extra_body=options).choices[0].text
    )


def test_unsupported_schema_feature_is_400_naming_it(builtin_server: Server) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as info:
        builtin_server.client().chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "numbers"}],
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        )
    assert info.value.body["param"] == "response_format"
    assert info.value.body["message"].endswith("cannot enforce: uniqueItems")
    builtin_server.assert_alive()


def test_generation_config_defaults_apply_to_requests(builtin_server: Server) -> None:
    """The built-in model's generation_config.json (temperature 0.7, top_p 0.95) fills what a
    request leaves out; a request's own field wins."""
    client = builtin_server.client()
    kw = dict(model=MODEL_NAME, prompt="def fibonacci(n):", max_tokens=20, seed=3)
    implicit = client.completions.create(**kw).choices[0].text
    explicit = client.completions.create(**kw, temperature=0.7, top_p=0.95).choices[0].text
    assert implicit == explicit
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    assert client.completions.create(**kw, temperature=0, top_p=0.5).choices[0].text == greedy
