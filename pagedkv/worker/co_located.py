"""Other pagedkv instances on this host whose cores overlap ours, found through ``/proc``.

An instance is a process whose command line runs an engine command (``pagedkv serve``,
``pagedkv generate``, ``pagedkv bench throughput``, also as ``python -m pagedkv ...``), or a
tensor-parallel worker rank of one (``python -m pagedkv.executor.worker_proc``): the proxy and
``bench serve`` (clients) are not instances. Our own process tree (ancestors and
descendants) is not another instance. The scan reads each process's ``cmdline`` once and never
fails: a process that ends or hides itself mid-scan is skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

#: A tensor-parallel worker rank's module, read as the command ``WORKER_RANK``.
WORKER_RANK_MODULE = "pagedkv.executor.worker_proc"
WORKER_RANK = "worker-rank"
#: The command words that start an engine (after ``pagedkv`` or ``python -m pagedkv``).
ENGINE_COMMANDS: tuple[tuple[str, ...], ...] = (
    ("serve",),
    ("generate",),
    ("bench", "throughput"),
    (WORKER_RANK,),
)
#: Python options that take a value as the next word (``python -X dev -m pagedkv serve``).
_PYTHON_OPTIONS_WITH_VALUE = ("-X", "-W", "-Q")
#: How far up a parent chain is followed (a chain is a few processes deep).
_MAX_ANCESTRY = 64
_PROC = Path("/proc")


class Neighbour(NamedTuple):
    """Another instance and the cores it may run on that we may run on too."""

    pid: int
    shared_cores: tuple[int, ...]


def pagedkv_arguments(argv: Sequence[str]) -> list[str] | None:
    """What follows ``pagedkv`` in a process's argv (the console script, run directly or by
    its interpreter, or ``python -m pagedkv``); None for any other program."""
    if not argv:
        return None
    if Path(argv[0]).name == "pagedkv":
        return list(argv[1:])
    if not Path(argv[0]).name.startswith("python"):
        return None
    i = 1
    while i < len(argv):
        word = argv[i]
        if word == "-m" or (word.startswith("-m") and len(word) > 2):
            module, rest = (argv[i + 1 : i + 2], i + 2) if word == "-m" else ([word[2:]], i + 1)
            if module == [WORKER_RANK_MODULE]:
                return [WORKER_RANK, *argv[rest:]]
            return list(argv[rest:]) if module == ["pagedkv"] else None
        if word == "-c" or word == "-":
            return None
        if word.startswith("-"):
            i += 2 if word in _PYTHON_OPTIONS_WITH_VALUE else 1
            continue
        return list(argv[i + 1 :]) if Path(word).name == "pagedkv" else None
    return None


def is_engine_command(argv: Sequence[str]) -> bool:
    """Whether ``argv`` starts a pagedkv engine (see ``ENGINE_COMMANDS``)."""
    arguments = pagedkv_arguments(argv)
    if arguments is None:
        return False
    return any(tuple(arguments[: len(words)]) == words for words in ENGINE_COMMANDS)


def _argv(pid: int) -> list[str]:
    raw = (_PROC / str(pid) / "cmdline").read_bytes()
    return [word.decode(errors="replace") for word in raw.split(b"\0")[:-1]]


def _parent(pid: int) -> int | None:
    """The parent's pid (``/proc/<pid>/stat``'s fourth field, after the parenthesised name)."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _ancestors(pid: int) -> list[int]:
    chain: list[int] = []
    parent = _parent(pid)
    while parent and len(chain) < _MAX_ANCESTRY:
        chain.append(parent)
        parent = _parent(parent)
    return chain


def engine_instances() -> list[int]:
    """The pids of the engine processes on this host, ours and our own tree's excluded."""
    me = os.getpid()
    family = {me, *_ancestors(me)}
    found = []
    try:
        pids = [int(entry.name) for entry in _PROC.iterdir() if entry.name.isdigit()]
    except OSError:  # no /proc here
        return []
    for pid in pids:
        if pid in family:
            continue
        try:
            if not is_engine_command(_argv(pid)):
                continue
        except OSError:
            continue
        if me not in _ancestors(pid):
            found.append(pid)
    return sorted(found)


def instances_sharing_cores(cores: Iterable[int]) -> list[Neighbour]:
    """The other engine instances that may run on any of ``cores``."""
    ours = set(cores)
    neighbours = []
    for pid in engine_instances():
        try:
            shared = ours & os.sched_getaffinity(pid)
        except OSError:
            continue
        if shared:
            neighbours.append(Neighbour(pid, tuple(sorted(shared))))
    return neighbours
