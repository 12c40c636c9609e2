#!/usr/bin/env python
"""xgrammar against llguidance on this CPU: the measurement behind pagedkv's grammar engine.

For each JSON schema below (and a regex and a choice), each engine compiles the grammar for a
tokenizer, then walks a valid instance token by token: fill the next-token bitmask, accept the
token. Reported per engine and schema: compile time (cold, no cache; until the first mask is
ready), and the median and p99 time of one mask fill over the walk (a decode step pays it once
per constrained request). Tokenizers: the built-in model's (4,096 tokens) and, with
``--vocab-size``, a byte-level BPE of that size trained here on the Python standard library
(real models have 32k-152k tokens; mask time grows with the vocabulary).

    python benchmarks/grammar_engines.py                        # built-in tokenizer
    python benchmarks/grammar_engines.py --vocab-size 32000     # + a 32k-token BPE (~1 min)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

SCHEMAS: dict[str, tuple[dict, object]] = {
    "flat object": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "admin": {"type": "boolean"},
            },
            "required": ["name", "age", "admin"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "admin": True},
    ),
    "nested + enums": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "status": {"enum": ["open", "closed", "merged"]},
                "labels": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                "author": {
                    "type": "object",
                    "properties": {
                        "login": {"type": "string", "minLength": 1, "maxLength": 39},
                        "site_admin": {"type": "boolean"},
                    },
                    "required": ["login"],
                    "additionalProperties": False,
                },
            },
            "required": ["id", "status", "labels", "author"],
            "additionalProperties": False,
        },
        {
            "id": 1347,
            "status": "merged",
            "labels": ["bug", "engine"],
            "author": {"login": "octocat", "site_admin": False},
        },
    ),
    "array of objects": (
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "x": {"type": "number"},
                    "y": {"type": "number"},
                    "tag": {"type": "string", "maxLength": 8},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 8,
        },
        [{"x": 1.5, "y": -2, "tag": "a"}, {"x": 0.25, "y": 3e2}, {"x": -7, "y": 11.125}],
    ),
    "anyOf + $ref": (
        {
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    "required": ["x", "y"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {
                "shape": {
                    "anyOf": [
                        {"$ref": "#/$defs/point"},
                        {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 4},
                    ]
                },
                "note": {"type": ["string", "null"]},
            },
            "required": ["shape", "note"],
            "additionalProperties": False,
        },
        {"shape": [{"x": 1, "y": 2}, {"x": 30, "y": -4}], "note": None},
    ),
    "any JSON object": ({"type": "object"}, {"k": [1, "two", {"three": 3.0}], "ok": True}),
}


def stdlib_bpe(vocab_size: int, cache: Path):
    """A byte-level BPE trained on the local Python standard library (cached on disk)."""
    from transformers import PreTrainedTokenizerFast

    path = cache / f"stdlib-bpe-{vocab_size}"
    if not (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
        texts = (f.read_text(errors="replace") for f in files)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
        fast.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.ll = llguidance
        self.np = llguidance.numpy
        t0 = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.setup_s = time.perf_counter() - t0
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        if kind == "json":
            grammar = self.ll.LLMatcher.grammar_from_json_schema(
                spec, defaults={"whitespace_flexible": True}
            )
        else:
            grammar = self.ll.grammar_from(kind, spec)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def bitmask(self):
        return self.np.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher, bitmask) -> None:
        self.np.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher, token_id: int) -> None:
        assert matcher.consume_token(token_id), matcher.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        t0 = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.setup_s = time.perf_counter() - t0
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json":
            compiled = compiler.compile_json_schema(json.dumps(spec), any_whitespace=True)
        elif kind == "regex":
            compiled = compiler.compile_regex(spec)
        else:  # choice
            alternatives = " | ".join(json.dumps(c) for c in spec)
            compiled = compiler.compile_grammar(f"root ::= {alternatives}")
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self):
        return self.xgr.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher, bitmask) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token_id: int) -> None:
        assert matcher.accept_token(token_id)


def measure(engine, kind: str, spec, text: str, token_ids: list[int], repeats: int) -> dict:
    compile_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        matcher = engine.compile(kind, spec)
        bitmask = engine.bitmask()
        engine.fill(matcher, bitmask)
        compile_s.append(time.perf_counter() - t0)
    fills = []
    for _ in range(repeats):
        matcher = engine.compile(kind, spec)
        bitmask = engine.bitmask()
        for token_id in token_ids:
            t0 = time.perf_counter()
            engine.fill(matcher, bitmask)
            fills.append(time.perf_counter() - t0)
            engine.accept(matcher, token_id)
    fills.sort()
    return {
        "compile_ms": 1e3 * statistics.median(compile_s),
        "mask_us_median": 1e6 * statistics.median(fills),
        "mask_us_p99": 1e6 * fills[int(0.99 * (len(fills) - 1))],
        "num_tokens": len(token_ids),
    }


def cases() -> list[tuple[str, str, object, str]]:
    out = [
        (name, "json", schema, json.dumps(instance, separators=(",", ":")))
        for name, (schema, instance) in SCHEMAS.items()
    ]
    out.append(("regex (date)", "regex", r"\d{4}-\d{2}-\d{2}", "2026-12-01"))
    out.append(("choice (3)", "choice", ["positive", "negative", "neutral"], "negative"))
    return out


def run(tokenizer, label: str, repeats: int, engines: list[str]) -> list[dict]:
    vocab_size = max(len(tokenizer), tokenizer.vocab_size)
    rows = []
    made = []
    for cls in (LLGuidance, XGrammar):
        if cls.name not in engines:
            continue
        try:
            made.append(cls(tokenizer, vocab_size))
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})", file=sys.stderr)
    for engine in made:
        print(f"[{label}] {engine.name}: tokenizer setup {engine.setup_s * 1e3:.1f} ms")
    for name, kind, spec, text in cases():
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        for engine in made:
            r = measure(engine, kind, spec, text, token_ids, repeats)
            r |= {"tokenizer": label, "engine": engine.name, "grammar": name}
            rows.append(r)
            print(
                f"[{label}] {name:18s} {engine.name:10s} compile {r['compile_ms']:8.2f} ms  "
                f"mask median {r['mask_us_median']:7.1f} us  p99 {r['mask_us_p99']:7.1f} us  "
                f"({r['num_tokens']} tokens)"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=None, help="also a BPE of this size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--cache-dir", default="/tmp/pagedkv-grammar-bench")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from pagedkv.engine.engine_args import DEFAULT_MODEL_PATH

    torch.set_num_threads(2)
    engines = args.engines.split(",")
    rows = run(
        AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH), "built-in 4k", args.repeats, engines
    )
    if args.vocab_size:
        tokenizer = stdlib_bpe(args.vocab_size, Path(args.cache_dir))
        rows += run(tokenizer, f"stdlib BPE {args.vocab_size // 1000}k", args.repeats, engines)
    for label in dict.fromkeys(r["tokenizer"] for r in rows):
        print(f"\n[{label}] geometric view: engine, median compile ms, median mask us")
        for engine in engines:
            mine = [r for r in rows if r["tokenizer"] == label and r["engine"] == engine]
            if mine:
                compile_ms = statistics.median(r["compile_ms"] for r in mine)
                mask_us = statistics.median(r["mask_us_median"] for r in mine)
                print(f"  {engine:10s} {compile_ms:8.2f} ms {mask_us:8.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
