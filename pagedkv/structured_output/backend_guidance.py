"""llguidance as the grammar engine: grammars compiled once (LRU cache), one matcher per request.

Why llguidance (``benchmarks/grammar_engines.py``, this CPU): it refuses JSON-schema keywords it
cannot enforce and names them ("Unimplemented keys: ["uniqueItems"]"), where xgrammar 0.2.8
accepts ``uniqueItems``, ``not``, ``contains``, ``if``/``then``, ``dependentRequired`` and
``propertyNames`` and then lets through outputs that break them; it compiles a schema in
1.3-13 ms (xgrammar: 1-257 ms); and it is one dependency-free wheel (xgrammar pulls torch,
transformers, triton and apache-tvm-ffi). Its mask costs more per token (30-160 us against 3-17
us at a 4k vocabulary), which a batched step pays once per constrained row.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from pagedkv.sampling_params import StructuredOutputsParams
from pagedkv.utils import cdiv

logger = logging.getLogger(__name__)

#: Compiled grammars kept (each a matcher in its start state, copied per request).
GRAMMAR_CACHE_SIZE = 256
#: JSON's flexible whitespace, bounded per gap between two JSON tokens (a newline and 19
#: spaces: pretty-printing seven levels deep at indent 2). Unbounded, a small model that likes
#: whitespace pads until max_tokens and the JSON never closes.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


class GrammarKey(NamedTuple):
    """What makes two requests' grammars the same: the cache key."""

    kind: str
    text: str
    disable_any_whitespace: bool

    @classmethod
    def of(cls, params: StructuredOutputsParams) -> GrammarKey:
        kind = params.kind
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            text = json.dumps(schema, sort_keys=True)
        elif kind == "choice":
            text = json.dumps(params.choice)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(params, kind)
        return cls(kind, text, params.disable_any_whitespace)


class CompileStats(NamedTuple):
    num_compiled: int
    compile_seconds: float
    num_cache_hits: int


class Grammar:
    """One request's matcher: the tokens it may sample next, advanced by those it sampled."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """False if a token broke the grammar (the matcher then stays stopped)."""
        if self._matcher.is_stopped():
            return True
        ok = self._matcher.consume_tokens(token_ids)
        if not ok:
            logger.warning("grammar rejected tokens %s: %s", token_ids, self._matcher.get_error())
        return ok

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed-token bits of the next position into ``bitmask[row]``."""
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: nothing but end-of-sequence may follow."""
        return self._matcher.is_stopped()


class GuidanceBackend:
    """Compiles grammars for one tokenizer. Thread-safe: requests are made on the API's
    thread while the engine thread steps."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self._eos_token_id = eos_token_id
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarKey, object] = OrderedDict()
        self._num_compiled = 0
        self._compile_seconds = 0.0
        self._num_cache_hits = 0

    @property
    def num_bitmask_words(self) -> int:
        return cdiv(self.vocab_size, 32)

    def stats(self) -> CompileStats:
        with self._lock:
            return CompileStats(self._num_compiled, self._compile_seconds, self._num_cache_hits)

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A matcher for ``params`` in its start state. Raises ValueError naming what the grammar
        engine cannot do."""
        key = GrammarKey.of(params)
        with self._lock:
            prototype = self._cache.get(key)
            if prototype is not None:
                self._cache.move_to_end(key)
                self._num_cache_hits += 1
                return Grammar(prototype.deep_copy())
            tokenizer = self._tokenizer()  # built once (0.1-3 s), not a compile
            start = time.perf_counter()
            prototype = self._compile(key, tokenizer)
            self._num_compiled += 1
            self._compile_seconds += time.perf_counter() - start
            self._cache[key] = prototype
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
            return Grammar(prototype.deep_copy())

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            eos = self._eos_token_id
            if eos is None:
                eos = self._hf_tokenizer.eos_token_id
            if eos is None:
                raise ValueError(
                    "structured_outputs need an end-of-sequence token, and this model's "
                    "tokenizer and generation config define none"
                )
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos
                )
            except (ValueError, TypeError) as e:
                raise ValueError(f"structured_outputs cannot use this tokenizer: {e}") from None
        return self._ll_tokenizer

    def _compile(self, key: GrammarKey, tokenizer):
        import llguidance

        if key.disable_any_whitespace:
            flexible = {"whitespace_flexible": False}
        else:
            flexible = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
        if key.kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(key.text, defaults=flexible)
        elif key.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults=flexible
            )
        else:
            grammar = llguidance.grammar_from(_GUIDANCE_FORMATS[key.kind], key.text)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        error = matcher.get_error()
        if error:
            raise ValueError(_describe(key.kind, error))
        return matcher


_GUIDANCE_FORMATS = {"regex": "regex", "choice": "choice", "grammar": "grammar"}


def _describe(kind: str, error: str) -> str:
    """The engine's error as a message that starts with the field and names what failed."""
    unimplemented = _UNIMPLEMENTED.search(error)
    if unimplemented:
        names = [n.strip().strip('"') for n in unimplemented.group(1).split(",")]
        return (
            "structured_outputs uses JSON schema keywords the grammar engine cannot enforce: "
            f"{', '.join(names)}"
        )
    what = {"json": "JSON schema", "grammar": "grammar"}.get(kind, kind)
    return f"structured_outputs has an invalid {what}: {error.strip()}"
