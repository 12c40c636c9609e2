"""Traces in the public format of the Mooncake traces, mapped onto pagedkv blocks.

A trace is JSON Lines, one request a line: ``timestamp`` (ms since the trace's start),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``, one id per 512-token block of
the prompt (the last one usually partial), where equal ids mean equal blocks and an id stands
for its block *and* everything before it (the ids are rolling hashes).

pagedkv replays a trace with one engine block of ``block_size`` deterministic token ids per
hash id instead of 512 tokens, so prefix reuse is exactly the trace's at a 512 / block_size
smaller scale: a length of ``n`` trace tokens becomes ``ceil(n * block_size / 512)`` tokens,
and the last hash id's block keeps the share of its 512 tokens that ``input_length`` fills.

``make_trace`` writes traces of that shape: conversations whose turns resend the growing
history (earlier questions and answers) after a system prompt all of them share.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

TRACE_BLOCK = 512  # tokens per hash id in the trace format
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _integer(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def parse_line(text: str, where: str) -> TraceRequest:
    """One trace line; ``where`` (``file:line``) names it in the ValueError a bad line raises."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON object ({e})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: not a JSON object")
    for name in FIELDS:
        if name not in record:
            raise ValueError(f"{where}: field {name!r} is missing")
    stamp = record["timestamp"]
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not stamp >= 0:
        raise ValueError(f"{where}: field 'timestamp' must be a number >= 0 (ms), got {stamp!r}")
    for name, minimum in (("input_length", 1), ("output_length", 0)):
        if not _integer(record[name], minimum):
            raise ValueError(
                f"{where}: field {name!r} must be an integer >= {minimum}, got {record[name]!r}"
            )
    ids = record["hash_ids"]
    if not isinstance(ids, list) or not ids or not all(_integer(i, 0) for i in ids):
        raise ValueError(
            f"{where}: field 'hash_ids' must be a non-empty list of integers >= 0, got {ids!r}"
        )
    return TraceRequest(float(stamp), record["input_length"], record["output_length"], tuple(ids))


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of a trace file, in timestamp order (blank lines skipped)."""
    requests = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                requests.append(parse_line(line, f"{path}:{lineno}"))
    if not requests:
        raise ValueError(f"{path}: no requests in the trace")
    return sorted(requests, key=lambda r: r.timestamp)


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for request in requests:
            record = asdict(request)
            record["hash_ids"] = list(request.hash_ids)
            if float(request.timestamp).is_integer():
                record["timestamp"] = int(request.timestamp)
            f.write(json.dumps(record) + "\n")


def scaled(trace_tokens: int, block_size: int) -> int:
    """A trace length in pagedkv tokens (one hash id = ``block_size`` tokens)."""
    return math.ceil(trace_tokens * block_size / TRACE_BLOCK)


def prompt_length(request: TraceRequest, block_size: int) -> int:
    """Tokens of the mapped prompt: every hash id's block full but the last, which keeps the
    share of its 512 tokens that ``input_length`` fills (at least one token, at most all)."""
    full = len(request.hash_ids) - 1
    rest = request.input_length - full * TRACE_BLOCK
    return full * block_size + min(max(scaled(rest, block_size), 1), block_size)


class BlockTokens:
    """Hash id -> ``block_size`` token ids in ``[low, vocab_size)``, the same for the same id
    and seed (drawn once per id)."""

    def __init__(self, block_size: int, vocab_size: int, seed: int = 0, low: int = 3) -> None:
        self.block_size, self.vocab_size, self.seed, self.low = block_size, vocab_size, seed, low
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        tokens = self._blocks.get(hash_id)
        if tokens is None:
            rng = np.random.default_rng((self.seed, hash_id))
            tokens = rng.integers(self.low, self.vocab_size, self.block_size).tolist()
            self._blocks[hash_id] = tokens
        return tokens

    def prompt(self, request: TraceRequest) -> list[int]:
        tokens = [t for hash_id in request.hash_ids for t in self.block(hash_id)]
        return tokens[: prompt_length(request, self.block_size)]


def full_block_chains(request: TraceRequest, block_size: int) -> list[tuple[int, ...]]:
    """The hash-id chain (ids up to and including its own) of each block the mapped prompt
    fills completely: the blocks a prefix cache can hold."""
    num_full = prompt_length(request, block_size) // block_size
    return [request.hash_ids[: i + 1] for i in range(num_full)]


class OracleCache:
    """The infinite prefix cache: every full block of every earlier prompt stays. A block of a
    prompt hits when its chain was seen, counted in tokens; a hit never covers the prompt's
    last token (the engine computes it to sample from), as in the engine."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seen: set[tuple[int, ...]] = set()

    def lookup(self, request: TraceRequest) -> int:
        """This request's hit tokens, caching nothing."""
        chains = full_block_chains(request, self.block_size)
        usable = (prompt_length(request, self.block_size) - 1) // self.block_size
        hits = 0
        while hits < min(usable, len(chains)) and chains[hits] in self.seen:
            hits += 1
        return hits * self.block_size

    def hit_tokens(self, request: TraceRequest) -> int:
        """This request's hit tokens; then its full blocks are cached."""
        hits = self.lookup(request)
        self.seen.update(full_block_chains(request, self.block_size))
        return hits


def oracle_hit_tokens(requests: Iterable[TraceRequest], block_size: int) -> list[int]:
    """Each request's hit tokens in the infinite cache, replaying in order."""
    oracle = OracleCache(block_size)
    return [oracle.hit_tokens(r) for r in requests]


def working_set_blocks(requests: Iterable[TraceRequest], block_size: int) -> int:
    """Distinct full blocks of the whole trace: what the infinite cache ends up holding."""
    return len({c for r in requests for c in full_block_chains(r, block_size)})


@dataclass(frozen=True, slots=True)
class TraceShape:
    """``make_trace``'s knobs; lengths in trace tokens (512 a hash id)."""

    conversations: int = 24
    turns: int = 6
    system_blocks: int = 8
    user_tokens: int = 6144
    output_tokens: int = 1024
    #: Mean ms between conversation starts (exponential) and between a turn and the
    #: conversation's next (uniform within 25 %: every other conversation speaks between two
    #: turns of one, as in a busy service).
    start_gap_ms: float = 500.0
    think_ms: float = 20000.0
    seed: int = 0


class _HashIds:
    """Ids in order of first use, by what the block holds: ("system", i), or a
    conversation's block i holding ``filled`` tokens (a partial block differs from the full
    block it later becomes)."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}

    def __call__(self, key: tuple) -> int:
        return self.ids.setdefault(key, len(self.ids))


def _conversation(
    shape: TraceShape, index: int, start: float, rng: random.Random, ids: _HashIds
) -> list[TraceRequest]:
    system = shape.system_blocks * TRACE_BLOCK
    history, stamp, requests = 0, start, []
    for _turn in range(shape.turns):
        history += max(1, round(shape.user_tokens * rng.uniform(0.5, 1.5)))
        length = system + history
        hash_ids = [ids(("system", i)) for i in range(shape.system_blocks)]
        for i in range(shape.system_blocks, math.ceil(length / TRACE_BLOCK)):
            filled = min(TRACE_BLOCK, length - i * TRACE_BLOCK)
            hash_ids.append(ids((index, i, filled)))
        output = max(1, round(shape.output_tokens * rng.uniform(0.5, 1.5)))
        requests.append(TraceRequest(round(stamp), length, output, tuple(hash_ids)))
        history += output
        stamp += shape.think_ms * rng.uniform(0.75, 1.25)
    return requests


def make_trace(shape: TraceShape) -> list[TraceRequest]:
    """``shape.conversations`` conversations of ``shape.turns`` turns, starting as a Poisson
    process; each turn resends the system prompt and the history (earlier questions and
    answers) with a new question, a think time after the previous turn.
    Deterministic from ``shape.seed``."""
    rng, ids = random.Random(shape.seed), _HashIds()
    starts, stamp = [], 0.0
    for _ in range(shape.conversations):
        starts.append(stamp)
        stamp += rng.expovariate(1 / shape.start_gap_ms)
    requests = [
        r for c, start in enumerate(starts) for r in _conversation(shape, c, start, rng, ids)
    ]
    # Ids numbered by first appearance in time, as the published traces number them.
    order = sorted(requests, key=lambda r: r.timestamp)
    renumber: dict[int, int] = {}
    for r in order:
        for h in r.hash_ids:
            renumber.setdefault(h, len(renumber))
    return [
        TraceRequest(
            r.timestamp, r.input_length, r.output_length, tuple(renumber[h] for h in r.hash_ids)
        )
        for r in order
    ]
