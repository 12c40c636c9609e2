"""The OpenAI-compatible server through the official ``openai`` client."""

from __future__ import annotations

import httpx

from tests.entrypoints.conftest import MODEL_NAME, Server, idle_connection_survives

PROMPT = "w5 w17 w42 w99"
MESSAGES = [
    {"role": "system", "content": "w7 w8"},
    {"role": "user", "content": "w9 w10 w11"},
]


def test_models_and_health(server: Server) -> None:
    (model,) = server.client().models.list().data
    assert model.id == MODEL_NAME and model.owned_by == "pagedkv"
    assert model.max_model_len == 256
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_completion_stream_equals_non_stream(server: Server) -> None:
    client = server.client()
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    (choice,) = full.choices
    assert choice.finish_reason == "length" and len(choice.text.split()) == 12
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.usage.prompt_tokens == 4 and full.usage.completion_tokens == 12
    assert full.usage.total_tokens == 16

    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.total_tokens == 16

    no_usage = list(client.completions.create(**kw, stream=True))
    assert all(c.usage is None and c.choices for c in no_usage)


def test_token_id_prompt_matches_text_prompt(server: Server) -> None:
    client = server.client()
    kw = dict(model=MODEL_NAME, max_tokens=6, temperature=0)
    by_text = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    by_ids = client.completions.create(prompt=[5, 17, 42, 99], **kw).choices[0].text
    assert by_ids == by_text


def test_chat_stream_equals_non_stream(server: Server) -> None:
    client = server.client()
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    (choice,) = full.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    # "w1 w7 w8 w4 w2 w9 w10 w11 w4 w3": the template's rendering, tokenized without extras.
    assert full.usage.prompt_tokens == 10 and full.usage.completion_tokens == 10
    # The rendered chat is the same tokens as this completion prompt.
    completion = client.completions.create(
        model=MODEL_NAME, prompt="w1 w7 w8 w4 w2 w9 w10 w11 w4 w3", max_tokens=10, temperature=0
    )
    assert choice.message.content == completion.choices[0].text

    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-2].choices[0].finish_reason == "length"

    old_name = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0
    )
    assert old_name.choices[0].message.content == choice.message.content


def test_completion_logprobs(server: Server) -> None:
    out = server.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    (choice,) = out.choices
    lp = choice.logprobs
    assert lp.tokens == choice.text.split()
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and top[token] == logprob
        assert len(top) == 3  # greedy: the chosen token is the best, so among the top 3
        assert logprob == max(top.values())
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]


def test_chat_logprobs(server: Server) -> None:
    out = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_completion_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == out.choices[0].message.content.split()
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode() == entry.token


def test_sampling_parameters(server: Server) -> None:
    client = server.client()
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12)
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    words = greedy.split()

    stopped = client.completions.create(**kw, temperature=0, stop=[words[3]]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == words[3]
    assert stopped.text == greedy[: greedy.index(words[3])]
    stop_id = int(words[2][1:])
    by_id = client.completions.create(
        **kw, temperature=0, extra_body={"stop_token_ids": [stop_id]}
    ).choices[0]
    assert by_id.text.split() == words[: words.index(words[2]) + 1]
    assert by_id.stop_reason == stop_id

    sampled = dict(temperature=1.0, top_p=0.9, seed=7, extra_body={"top_k": 50, "min_p": 0.01})
    first = client.completions.create(**kw, **sampled).choices[0].text
    assert client.completions.create(**kw, **sampled).choices[0].text == first
    penalized = client.completions.create(
        **kw,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.3, "ignore_eos": True},
    )
    assert len(penalized.choices[0].text.split()) == 12


def test_vllm_extensions_pass_through(server: Server) -> None:
    params = {"do_remote_decode": True, "remote_block_ids": [1, 2, 3]}
    out = server.client().completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=1,
        extra_body={"kv_transfer_params": params, "priority": 3, "cache_salt": "tenant-a"},
    )
    assert out.model_extra["kv_transfer_params"] == params
    chat = server.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 1, "kv_transfer_params": params},
    ).json()
    assert chat["kv_transfer_params"] == params


def test_prefix_cache_hits_are_reported(server: Server) -> None:
    client = server.client()
    prompt = [3 + i % 200 for i in range(40)]  # two full 16-token blocks, then a partial one
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    salted = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "other"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_request_id_header_names_the_response(server: Server) -> None:
    response = server.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 2},
        headers={"X-Request-Id": "proxy-42"},
    )
    assert response.json()["id"] == "cmpl-proxy-42"


def test_an_idle_connection_outlives_a_clients_own_expiry(server: Server) -> None:
    """The server keeps an idle keep-alive connection longer than httpx (the proxy's and
    bench serve's client) keeps it pooled, 5 s. With uvicorn's 5 s default both timed out
    together: under load a client sometimes reused a connection as the server closed it,
    and the request failed with a ReadError (about one in 600 at 64 clients)."""
    assert idle_connection_survives(server.base_url, idle_s=6.0)
