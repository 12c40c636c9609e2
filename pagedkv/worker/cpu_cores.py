"""Core lists (``--cpu-cores``, ``VLLM_CPU_OMP_THREADS_BIND``): taskset's syntax, and which
list an instance is asked to run on.

    "0-3,6"     -> (0, 1, 2, 3, 6)
    "0-6:2"     -> (0, 2, 4, 6)        (a stride, as ``taskset -c`` reads it)
    (0, 1, 2, 3, 6) -> "0-3,6"         (``format_cpu_list``: sorted, runs as ranges)

``parse_cpu_list(format_cpu_list(cores)) == tuple(sorted(set(cores)))`` for any non-empty set
of core numbers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

#: vLLM's CPU backend variable: a core list, ``all`` (no binding) or ``auto`` (vLLM picks; here:
#: no binding either, but the check for instances sharing our cores runs as it always does).
OMP_THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_UNBOUND_WORDS = ("all", "auto")
#: Above any machine's core count (Linux: 8192 at most), so a typo cannot build a huge set.
_MAX_CORE = 1 << 16
_ITEM = re.compile(r"(\d+)(?:-(\d+)(?::(\d+))?)?")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The sorted distinct cores of ``text``; ValueError (saying what is wrong) when it is not
    a core list."""
    cores: set[int] = set()
    for item in text.split(","):
        match = _ITEM.fullmatch(item.strip())
        if match is None:
            raise ValueError(f"{item.strip()!r} is not a core, a range N-M or N-M:STRIDE")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        stride = int(match.group(3)) if match.group(3) is not None else 1
        if last < first or stride < 1:
            raise ValueError(f"{item.strip()!r} is an empty range")
        if last >= _MAX_CORE:
            raise ValueError(f"{item.strip()!r}: no machine has core {last}")
        cores.update(range(first, last + 1, stride))
    return tuple(sorted(cores))


def format_cpu_list(cores: Iterable[int]) -> str:
    """The shortest list without strides: consecutive cores as ``N-M``."""
    ordered = sorted(set(cores))
    runs: list[str] = []
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            first, last = ordered[start], ordered[i - 1]
            runs.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return ",".join(runs)


def allowed_cores() -> set[int]:
    """The cores this process may run on (its affinity); ValueError where the OS cannot say."""
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("binding to cores needs Linux (os.sched_getaffinity)")
    return os.sched_getaffinity(0)


def check_cpu_list(text: str, allowed: Iterable[int] | None = None) -> tuple[int, ...]:
    """``parse_cpu_list`` of ``text``, whose cores must all be in ``allowed`` (default: this
    process's affinity): ValueError naming the ones that are not."""
    cores = parse_cpu_list(text)
    allowed = set(allowed_cores() if allowed is None else allowed)
    missing = [core for core in cores if core not in allowed]
    if missing:
        raise ValueError(
            f"core(s) {format_cpu_list(missing)}: this process may only run on "
            f"{format_cpu_list(allowed)}"
        )
    return cores


class CoreRequest(NamedTuple):
    """The cores asked for and where the request came from (for the log and the errors)."""

    #: None: no binding (nothing asked, or ``all`` / ``auto``).
    cores: tuple[int, ...] | None
    #: ``--cpu-cores``, ``VLLM_CPU_OMP_THREADS_BIND`` or "" when nothing was asked.
    source: str


def requested_cores(cpu_cores: str | None, environ: Mapping[str, str] = os.environ) -> CoreRequest:
    """``--cpu-cores`` (``cpu_cores``) wins over ``VLLM_CPU_OMP_THREADS_BIND``. ValueError,
    naming the source, for a malformed list, a core this process may not run on, or vLLM's
    per-tensor-parallel-rank form (``0-1|2-3``: one instance runs one rank here)."""
    if cpu_cores is not None:
        try:
            return CoreRequest(check_cpu_list(cpu_cores), "--cpu-cores")
        except ValueError as e:
            raise ValueError(f"cpu_cores {cpu_cores!r}: {e}") from None
    text = environ.get(OMP_THREADS_BIND_ENV, "").strip()
    if not text or text in _UNBOUND_WORDS:
        return CoreRequest(None, OMP_THREADS_BIND_ENV if text else "")
    if "|" in text:
        raise ValueError(
            f"{OMP_THREADS_BIND_ENV}={text!r}: one core list per tensor-parallel rank ('|') "
            "needs --tensor-parallel-size > 1 (this instance runs one rank); give one list, "
            "e.g. 0-3"
        )
    try:
        return CoreRequest(check_cpu_list(text), OMP_THREADS_BIND_ENV)
    except ValueError as e:
        raise ValueError(f"{OMP_THREADS_BIND_ENV}={text!r}: {e}") from None


def rank_cpu_cores(
    cpu_cores: str | None, tp_size: int, environ: Mapping[str, str] = os.environ
) -> list[str | None]:
    """Each tensor-parallel rank's ``--cpu-cores`` (its ``WorkerConfig.cpu_cores``), disjoint:

    - one list per rank, ``|``-separated (``0-3|4-7``, vLLM's form), from ``--cpu-cores`` or
      ``VLLM_CPU_OMP_THREADS_BIND``: exactly ``tp_size`` lists, no core in two;
    - one list: cut into ``tp_size`` equal runs (the cores left over stay unused);
    - nothing asked (or ``all`` / ``auto``): this process's cores cut the same way, so ranks
      never share a core; unpinned when there are fewer cores than ranks.

    With one rank, ``cpu_cores`` as given (``requested_cores`` reads it and the variable).
    ValueError, naming the source, for lists that do not fit."""
    if tp_size == 1:
        return [cpu_cores]
    source = "--cpu-cores" if cpu_cores is not None else OMP_THREADS_BIND_ENV
    text = cpu_cores if cpu_cores is not None else environ.get(OMP_THREADS_BIND_ENV, "").strip()
    if text in ("", *_UNBOUND_WORDS):
        cores = sorted(allowed_cores())
        if len(cores) < tp_size:
            return [None] * tp_size
        return [format_cpu_list(part) for part in _equal_runs(cores, tp_size)]
    try:
        if "|" in text:
            lists = [check_cpu_list(part) for part in text.split("|")]
            if len(lists) != tp_size:
                raise ValueError(f"{len(lists)} lists for {tp_size} tensor-parallel ranks")
            if sum(map(len, lists)) != len(set().union(*lists)):
                raise ValueError("a core is in two ranks' lists")
            return [format_cpu_list(cores) for cores in lists]
        cores = list(check_cpu_list(text))
        if len(cores) < tp_size:
            raise ValueError(f"{len(cores)} core(s) for {tp_size} tensor-parallel ranks")
        return [format_cpu_list(part) for part in _equal_runs(cores, tp_size)]
    except ValueError as e:
        raise ValueError(f"{source} {text!r}: {e}") from None


def _equal_runs(cores: list[int], parts: int) -> list[list[int]]:
    size = len(cores) // parts
    return [cores[i * size : (i + 1) * size] for i in range(parts)]
