"""``echo`` on /v1/completions (vLLM's): the prompt's text, tokens and logprobs before the
generated ones, checked against transformers' logits on the same tiny model.

The server prefills at most 16 tokens a step, so a 40-token prompt's logprobs come over three
chunks (a stream must gather them before its first chunk echoes the prompt).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.entrypoints.conftest import MODEL_NAME, Server, serve
from tests.tiny_models import random_prompt

PROMPT_IDS = random_prompt(40, seed=11)
PROMPT = " ".join(f"w{i}" for i in PROMPT_IDS)
#: fp32 on both sides: only the order of float operations differs.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def chunked_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serve(tmp_path_factory, str(tiny_model), "--max-num-batched-tokens", "16")


@pytest.fixture(scope="module")
def reference(tiny_model: Path):
    """``reference(ids)``: transformers' log-softmax at each position of ``ids``."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return log_softmax


def token_ids(logprobs) -> list[int]:
    return [int(token.removeprefix("w")) for token in logprobs.tokens]


def assert_matches_reference(logprobs, ids: list[int], reference, k: int) -> None:
    """Every position's logprob and top-``k`` against transformers': the first token has none;
    each entry holds the token and the vocabulary's top ``k`` (ranks 1..k, in rank order after
    the token itself), each with transformers' value."""
    expected = reference(ids)
    assert token_ids(logprobs) == ids
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))]
    assert logprobs.text_offset == offsets
    for pos in range(1, len(ids)):
        row = expected[pos - 1]
        assert logprobs.token_logprobs[pos] == pytest.approx(row[ids[pos]].item(), abs=TOLERANCE)
        top = logprobs.top_logprobs[pos]
        top_k = row.topk(k).indices.tolist()
        assert set(top) == {f"w{t}" for t in [ids[pos], *top_k]}
        assert list(top)[0] == f"w{ids[pos]}"
        ranked = [t for t in top_k if t != ids[pos]]
        assert list(top)[len(top) - len(ranked) :] == [f"w{t}" for t in ranked]
        for token, value in top.items():
            assert value == pytest.approx(row[int(token[1:])].item(), abs=TOLERANCE)


def joined(chunks) -> dict[int, dict]:
    """Per choice: its chunks' text and logprob lists joined, and its first chunk."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            entry = out.setdefault(
                choice.index, {"first": choice, "text": "", "tokens": [], "token_logprobs": []}
            )
            entry["text"] += choice.text
            entry["finish_reason"] = choice.finish_reason
            if choice.logprobs is not None:
                entry["tokens"] += choice.logprobs.tokens
                entry["token_logprobs"] += choice.logprobs.token_logprobs
                entry.setdefault("text_offset", []).extend(choice.logprobs.text_offset)
                entry.setdefault("top_logprobs", []).extend(choice.logprobs.top_logprobs)
    return out


def test_echo_logprobs_match_transformers_despite_a_warm_prefix_cache(
    chunked_server: Server, reference
) -> None:
    """The prompt's KV is in the prefix cache (a plain request hits it), yet an echo request
    computes every prompt position; asked twice, it answers the same."""
    client = chunked_server.client()
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    client.completions.create(**kw)
    plain = client.completions.create(**kw)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0

    echoes = [client.completions.create(**kw, echo=True) for _ in range(2)]
    for echo in echoes:
        (choice,) = echo.choices
        assert choice.text == PROMPT + plain.choices[0].text
        assert choice.finish_reason == "length"
        generated = token_ids(plain.choices[0].logprobs)
        assert_matches_reference(choice.logprobs, PROMPT_IDS + generated, reference, k=3)
        assert choice.logprobs.token_logprobs[40:] == pytest.approx(
            plain.choices[0].logprobs.token_logprobs, abs=TOLERANCE
        )
        assert echo.usage.prompt_tokens == 40 and echo.usage.completion_tokens == 5
        assert echo.usage.prompt_tokens_details.cached_tokens == 0
    first, second = (e.choices[0].logprobs for e in echoes)
    assert second.tokens == first.tokens and second.top_logprobs[0] is None
    assert second.token_logprobs[1:] == pytest.approx(first.token_logprobs[1:], abs=1e-6)


def test_streamed_echo_equals_the_whole_answer(chunked_server: Server) -> None:
    client = chunked_server.client()
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True)
    full = client.completions.create(**kw).choices[0]
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    streamed = joined(chunks[:-1])[0]
    first = streamed["first"]
    assert first.text.startswith(PROMPT) and first.logprobs.tokens[:40] == full.logprobs.tokens[:40]
    assert first.logprobs.token_logprobs[0] is None and first.logprobs.top_logprobs[0] is None
    assert streamed["text"] == full.text and streamed["finish_reason"] == "length"
    assert streamed["tokens"] == full.logprobs.tokens
    assert streamed["text_offset"] == full.logprobs.text_offset
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(full.logprobs.token_logprobs[1:])
    assert [None if t is None else set(t) for t in streamed["top_logprobs"]] == [
        None if t is None else set(t) for t in full.logprobs.top_logprobs
    ]
    usage = chunks[-1].usage
    assert usage.prompt_tokens == 40 and usage.completion_tokens == 6


def test_echo_with_max_tokens_0_answers_the_prompt_alone(chunked_server: Server, reference) -> None:
    client = chunked_server.client()
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True)
    with_logprobs = client.completions.create(**kw, logprobs=1)
    (choice,) = with_logprobs.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert_matches_reference(choice.logprobs, PROMPT_IDS, reference, k=1)
    assert with_logprobs.usage.completion_tokens == 0
    assert with_logprobs.usage.total_tokens == 40

    without = client.completions.create(**kw).choices[0]
    assert without.text == PROMPT and without.logprobs is None

    chunks = list(
        client.completions.create(
            **kw, logprobs=1, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = joined(chunks[:-1])[0]
    assert streamed["text"] == PROMPT and streamed["tokens"] == choice.logprobs.tokens
    assert chunks[-1].usage.completion_tokens == 0

    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)


def test_batched_token_id_prompts_each_echo_their_own(chunked_server: Server, reference) -> None:
    """Two token-id prompts, ``n=2``: choice ``i * 2 + j`` echoes prompt ``i``'s decoded text
    and logprobs, streamed (each choice's first chunk) or not."""
    client = chunked_server.client()
    prompts = [random_prompt(20, seed=3), [7, 8, 9]]
    kw = dict(
        model=MODEL_NAME, prompt=prompts, n=2, max_tokens=4, temperature=1.0, seed=5, logprobs=1
    )
    full = client.completions.create(**kw, echo=True)
    plain = client.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    for choice, alone in zip(full.choices, plain.choices):
        prompt = prompts[choice.index // 2]
        prompt_text = " ".join(f"w{i}" for i in prompt)
        assert choice.text == prompt_text + alone.text
        generated = token_ids(alone.logprobs)
        assert_matches_reference(choice.logprobs, prompt + generated, reference, k=1)
    assert full.usage.prompt_tokens == 23 and full.usage.completion_tokens == 16

    streamed = joined(client.completions.create(**kw, echo=True, stream=True))
    assert sorted(streamed) == [0, 1, 2, 3]
    for choice in full.choices:
        entry = streamed[choice.index]
        prompt_len = len(prompts[choice.index // 2])
        assert entry["first"].logprobs.tokens[:prompt_len] == choice.logprobs.tokens[:prompt_len]
        assert entry["text"] == choice.text and entry["tokens"] == choice.logprobs.tokens
        assert entry["text_offset"] == choice.logprobs.text_offset
