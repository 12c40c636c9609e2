"""SamplingParams: how one request samples and when it stops. Validated at construction."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

MAX_LOGPROBS = 20
#: Sequences per request: each is a request of its own in the scheduler, so one request must
#: not become millions (the default max_num_seqs).
MAX_N = 256
#: top_k becomes an int64 tensor; a k above the vocabulary size keeps every token anyway.
MAX_TOP_K = 2**31
#: Stored as Python floats: the model runner turns them into float32 tensors.
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite_number(x: object) -> bool:
    """Not NaN, not infinite, and no integer too large for a float (compared exactly)."""
    return (
        isinstance(x, int | float)
        and not isinstance(x, bool)
        and -sys.float_info.max <= x <= sys.float_info.max
    )


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one of ``json`` (a JSON schema, as a dict or text),
    ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (Lark / EBNF) or
    ``json_object`` (any JSON object). ``disable_any_whitespace`` makes JSON compact (no
    whitespace beyond the separators' single spaces)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(_STRUCTURED_KINDS)}, got {given or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs json is not valid JSON: {e}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs json must be a JSON schema (an object)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs choice must be a list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False))


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class RequestOutputKind(IntEnum):
    """vLLM's: what each of a request's outputs holds. ``CUMULATIVE``: every output so far
    (text and tokens from the start); ``DELTA``: only what is new since the request's last
    output; ``FINAL_ONLY``: one output, when the request finishes (``LLM.generate``'s)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """vLLM's sampling parameters (the subset pagedkv implements).

    ``temperature=0`` is greedy. ``top_k`` 0 or -1 and ``top_p`` 1 disable those filters.
    Penalties follow OpenAI/vLLM: presence and frequency act on output tokens, repetition on
    prompt and output tokens. ``seed`` makes one request's sampling reproducible whatever else
    is in the batch. ``max_tokens=None`` means up to the model's context length. ``n > 1`` is
    parallel sampling: the engine runs ``n`` child requests that share the prompt's KV blocks
    through the prefix cache; child ``i`` samples with ``seed + i`` (vLLM's derivation).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: vLLM's: what ``min_tokens`` keeps from being sampled, the stop token ids and (once
    #: ``update_from_generation_config`` ran) every EOS id, whatever ``ignore_eos`` says.
    all_stop_token_ids: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self._validate()
        self.all_stop_token_ids = frozenset(self.stop_token_ids)
        for name in _FLOAT_FIELDS:  # an integer temperature must not make an int64 tensor
            setattr(self, name, float(getattr(self, name)))

    def _validate(self) -> None:
        def fail(name: str, requirement: str) -> None:
            raise ValueError(f"{name} {requirement}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            fail("n", f"must be an integer in [1, {MAX_N}]")
        for name in _FLOAT_FIELDS:
            if not _is_finite_number(getattr(self, name)):
                fail(name, "must be a finite number")
        if not self.temperature >= 0:
            fail("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k < MAX_TOP_K:
            fail("top_k", "must be an integer in [-1, 2**31) (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            fail("repetition_penalty", "must be > 0")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            fail("seed", "must be an integer in [-2**63, 2**64)")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"must be an integer in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a boolean")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            fail("structured_outputs", "must be a StructuredOutputsParams")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "must be a RequestOutputKind")

    def update_from_generation_config(
        self, eos_token_ids: Sequence[int], eos_token_id: int | None
    ) -> None:
        """Fold the checkpoint's EOS ids into this request's stop ids, as vLLM's method of
        this name does. The engine calls it on each request's own copy.

        - ``eos_token_id``, the primary EOS, ends the request unless ``ignore_eos``; the
          scheduler checks it on its own, so it does not join ``stop_token_ids``.
        - The generation config's other EOS ids (its ``eos_token_id`` may be a list) join
          ``stop_token_ids`` unless ``ignore_eos``: they end the request with ``stop_reason``
          set to the id; under ``ignore_eos`` they do not end it.
        - ``min_tokens`` masks ``all_stop_token_ids``: the stop token ids and every EOS id,
          primary and extra, even under ``ignore_eos`` (transformers' ``min_new_tokens``
          masks every EOS id too).
        """
        extra = [t for t in dict.fromkeys(eos_token_ids) if t != eos_token_id]
        primary = () if eos_token_id is None else (eos_token_id,)
        self.all_stop_token_ids = self.all_stop_token_ids.union(primary, extra)
        if extra and not self.ignore_eos:
            self.stop_token_ids = list(dict.fromkeys([*self.stop_token_ids, *extra]))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )
