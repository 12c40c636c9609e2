"""A finished request's text is the decode of its token ids, even where the bytes a model
emits (or a prompt ends with) never complete a character."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from pagedkv import LLM, SamplingParams
from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.engine_args import DEFAULT_MODEL_PATH


def test_text_equals_the_decode_of_the_token_ids_for_byte_soup_prompts() -> None:
    """Random byte tokens as prompts: once the bytes a prompt ended with came out as the first
    output text, and output bytes that never formed a character were dropped at the end."""
    llm = LLM(str(DEFAULT_MODEL_PATH))
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    for seed in range(24):
        rng = random.Random(seed)
        prompt = [rng.randrange(5, 256) for _ in range(rng.randrange(5, 60))]
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=16)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        completion = out.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_held_back_bytes_come_out_at_the_end_as_replacement_characters() -> None:
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    (lone_byte,) = tokenizer.convert_tokens_to_ids(["Ģ"])  # 0xE2: starts a 3-byte character
    detokenizer = IncrementalDetokenizer(tokenizer, [40, 41], skip_special_tokens=True)
    assert [detokenizer.step(lone_byte) for _ in range(3)] == ["", "", ""]
    assert detokenizer.flush() == "\ufffd" * 3 and detokenizer.flush() == ""


def test_a_non_ascii_prompt_gets_replacement_characters_only_for_bytes_that_are_not_utf8() -> None:
    """The issue's prompt comes back as a run of U+FFFD: the built-in model (trained on nearly
    all-ASCII text) answers it greedily with the lone continuation byte 0x80, again and again.
    Each such byte is one U+FFFD, as ``tokenizer.decode`` renders it; no other U+FFFD appears,
    and the prompt itself round-trips."""
    llm = LLM(str(DEFAULT_MODEL_PATH))
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    prompt = "日本語 😀 ünïcödé"
    assert tokenizer.decode(tokenizer.encode(prompt)) == prompt
    params = SamplingParams(temperature=0, max_tokens=12)
    (completion,) = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    assert completion.text == tokenizer.decode(completion.token_ids)
    lone_bytes = [t for t in completion.token_ids if tokenizer.decode([t]) == "\ufffd"]
    assert completion.text.count("\ufffd") == len(lone_bytes) > 0
