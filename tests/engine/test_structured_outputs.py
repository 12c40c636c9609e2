"""Structured outputs through the engine, on the built-in model (a byte-level BPE tokenizer that
can spell any JSON): grammars from llguidance, the bitmask applied in the batched sampler."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagedkv import LLM, SamplingParams
from pagedkv.engine.engine_args import DEFAULT_MODEL_PATH
from pagedkv.sampling_params import StructuredOutputsParams
from tests.engine.conftest import assert_all_blocks_free

#: Context 256: prompt + the longest output a schema allows must fit.
MAX_TOKENS = 230
PROMPT = "data = "


@pytest.fixture(scope="module")
def llm():
    llm = LLM(str(DEFAULT_MODEL_PATH), max_num_seqs=32)
    yield llm
    assert_all_blocks_free(llm)


def constrained(**kind) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=kind.pop("seed", 0),
        n=kind.pop("n", 1),
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(disable_any_whitespace=True, **kind),
    )


# ---------------------------------------------------------------- random schemas (hypothesis)
def _max_bytes(schema: dict) -> int:
    """The longest JSON text the schema allows, compact (a token is at least one byte)."""
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "boolean":
        return 5
    if kind == "string":  # a code point escaped as a surrogate pair: \\ud83d\\ude00
        return 2 + 12 * schema["maxLength"]
    if kind == "array":
        return 2 + schema["maxItems"] * (_max_bytes(schema["items"]) + 1)
    return 2 + sum(len(json.dumps(k)) + 2 + _max_bytes(v) for k, v in schema["properties"].items())


names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
integers = st.tuples(st.integers(-1000, 1000), st.integers(0, 500)).map(
    lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
)
strings = st.tuples(st.integers(0, 3), st.integers(0, 3)).map(
    lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]}
)
enums = st.lists(
    st.one_of(names, st.integers(-50, 50), st.booleans()), min_size=1, max_size=4, unique=True
).map(lambda values: {"enum": values})
leaves = st.one_of(integers, strings, enums, st.just({"type": "boolean"}))


def _object(properties: dict, required: list[str]) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": [name for name in properties if name in required],
        "additionalProperties": False,
    }


def _extend(children):
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )
    objects = st.tuples(
        st.dictionaries(names, children, min_size=1, max_size=3), st.lists(names)
    ).map(lambda t: _object(*t))
    return st.one_of(arrays, objects)


schemas = st.recursive(leaves, _extend, max_leaves=6)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=schemas, seed=st.integers(0, 2**16))
def test_random_schemas_at_temperature_one_always_validate(llm, schema, seed) -> None:
    assume(_max_bytes(schema) <= MAX_TOKENS - 5)
    (out,) = llm.generate([PROMPT], constrained(json=schema, seed=seed, n=3), use_tqdm=False)
    for completion in out.outputs:
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


# ---------------------------------------------------------------- the other kinds
def test_regex_choice_grammar_and_json_object(llm) -> None:
    date, choice, any_object, lark = llm.generate(
        [PROMPT] * 4,
        [
            constrained(regex=r"\d{4}-\d{2}-\d{2}"),
            constrained(choice=["positive", "negative", "neutral"], n=4),
            constrained(json_object=True),
            constrained(grammar='start: "x" ("+" "x")* "=" NUMBER\nNUMBER: /[0-9]{1,3}/'),
        ],
        use_tqdm=False,
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.outputs[0].text)
    assert {c.text for c in choice.outputs} <= {"positive", "negative", "neutral"}
    assert isinstance(json.loads(any_object.outputs[0].text), dict)
    assert re.fullmatch(r"x(\+x)*=[0-9]{1,3}", lark.outputs[0].text)


def test_non_ascii_output_comes_out_whole(llm) -> None:
    """A replacement character comes only from bytes that are not UTF-8: a grammar that spells
    non-ASCII text gets it back intact, through the incremental detokenizer."""
    (out,) = llm.generate([PROMPT], constrained(choice=["日本語 😀 ünïcödé"]), use_tqdm=False)
    assert out.outputs[0].text == "日本語 😀 ünïcödé"


def test_constrained_and_free_requests_share_a_batch(llm) -> None:
    """The mask touches only its own rows: a free request samples the same tokens beside
    constrained ones as alone."""
    free = SamplingParams(temperature=1.0, seed=42, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPT], free, use_tqdm=False)[0].outputs[0].token_ids
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    outs = llm.generate(
        [PROMPT] * 3, [constrained(json=schema), free, constrained(json=schema, seed=1)],
        use_tqdm=False,
    )  # fmt: skip
    assert outs[1].outputs[0].token_ids == alone
    for out in (outs[0], outs[2]):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_grammars_are_compiled_once(llm) -> None:
    manager = llm.llm_engine.structured_outputs
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}
    reordered = {"required": ["k"], "properties": {"k": {"enum": ["x", "y"]}}, "type": "object"}
    before = manager.compile_stats()
    llm.generate([PROMPT] * 3, constrained(json=schema, n=2), use_tqdm=False)
    llm.generate([PROMPT], constrained(json=json.dumps(reordered)), use_tqdm=False)
    after = manager.compile_stats()
    assert after.num_compiled == before.num_compiled + 1
    assert after.num_cache_hits == before.num_cache_hits + 6


@pytest.mark.parametrize(
    "schema, names",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
        ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if, then"),
    ],
)
def test_schema_features_the_engine_cannot_enforce_are_named(llm, schema, names) -> None:
    with pytest.raises(ValueError, match=f"cannot enforce: {names}$"):
        llm.generate([PROMPT], constrained(json=schema), use_tqdm=False)


def test_bad_structured_outputs_are_refused() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="choice must be a list of non-empty strings"):
        StructuredOutputsParams(choice=[])
