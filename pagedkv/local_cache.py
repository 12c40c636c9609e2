"""The files pagedkv keeps per machine: where they live, what names this CPU, how they are written.

They live under ``$XDG_CACHE_HOME/pagedkv`` (default ``~/.cache/pagedkv``). Each is written
in a scratch directory beside its final name and renamed into place, so concurrent writers need
no lock and a killed writer leaves nothing half-written behind: a reader sees the old file
whole or the new one whole.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedkv"


def cpu_description() -> list[str]:
    """This CPU's model name and flags (``/proc/cpuinfo``'s first two such lines; empty where
    there is none): what code built or timed for this CPU depends on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]


@contextmanager
def replacing(target: Path) -> Iterator[Path]:
    """A scratch directory beside ``target``: whatever the body writes to
    ``scratch / target.name`` replaces ``target`` when the body returns (nothing does when it
    raises). The scratch directory goes either way."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        yield Path(scratch)
        os.replace(Path(scratch) / target.name, target)
