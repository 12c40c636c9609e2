"""Choosing between two equivalent implementations by timing them on this machine, once.

Equivalent implementations (MKL or oneDNN for a batch's product, one weight layout or the
other) agree up to fp32 rounding, not bit for bit. Timed afresh at every start, a choice can
flip on a loaded machine, and the same greedy request then answers differently after a restart.
So ``KernelChoices`` times each choice once per machine and keeps it in a small JSON file beside
the compiled kernels; later starts read it and time nothing. ``--retune-kernels`` (or
``$PAGEDKV_RETUNE_KERNELS=1``) times every choice again and rewrites the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedkv.cpu_kernels import library_path
from pagedkv.local_cache import cache_dir, cpu_description, replacing

logger = logging.getLogger(__name__)

#: Rows of the batch that batched products are timed with (a mid-size decode batch).
TUNE_ROWS = 32
#: ``1``: time every choice again at start and rewrite the file (as ``--retune-kernels``).
RETUNE_ENV = "PAGEDKV_RETUNE_KERNELS"
#: Where the choices file lives (default: the compiled kernels' cache directory).
CHOICES_DIR_ENV = "PAGEDKV_KERNEL_CHOICES_DIR"


def first_is_faster(
    first: Callable[[], object], second: Callable[[], object], repeats: int
) -> bool:
    """Both, alternately, ``repeats`` times after a warm-up round (not counted): whether
    ``first`` has the smaller median time. Alternating makes both meet the same machine on a
    host whose speed drifts."""
    times: tuple[list[float], list[float]] = ([], [])
    with torch.no_grad():
        for attempt in range(repeats + 1):
            for run, recorded in zip((first, second), times):
                start = time.perf_counter()
                run()
                if attempt:
                    recorded.append(time.perf_counter() - start)
    return statistics.median(times[0]) < statistics.median(times[1])


def _machine() -> dict[str, object]:
    """What a timing depends on besides the shapes: CPU, torch (MKL, oneDNN), threads, and the
    compiled kernels (the one-row GEMV is one of the timed)."""
    return {
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "kernels": library_path().name,
    }


class KernelChoices:
    """The timed choices of one machine, by key (the choice and its shapes): each is read from
    ``path`` where the file holds it, else timed now. ``save`` writes those timed now into the
    file: ``{"machine": {...}, "choices": {key: first_is_faster}}``. A file that cannot be read
    or parsed counts as absent, with a warning."""

    def __init__(self, path: Path, retune: bool = False) -> None:
        self.path = path
        self._cached = {} if retune else self._read(warn=True)
        self._timed: dict[str, bool] = {}
        self._num_read = 0

    @classmethod
    def for_this_machine(cls, retune: bool = False) -> KernelChoices:
        """The file of this machine in ``$PAGEDKV_KERNEL_CHOICES_DIR`` (default
        ``local_cache.cache_dir()``); timed again where ``retune`` or ``$PAGEDKV_RETUNE_KERNELS``
        is ``1``."""
        machine = json.dumps(_machine(), sort_keys=True)
        name = f"kernel_choices_{hashlib.sha256(machine.encode()).hexdigest()[:16]}.json"
        directory = os.environ.get(CHOICES_DIR_ENV) or cache_dir()
        return cls(Path(directory) / name, retune or os.environ.get(RETUNE_ENV) == "1")

    def first_is_faster(
        self, key: str, first: Callable[[], object], second: Callable[[], object], repeats: int
    ) -> bool:
        """The file's answer for ``key``; else ``first_is_faster(first, second, repeats)``,
        timed once per key."""
        if key in self._cached:
            self._num_read += 1
            return self._cached[key]
        if key not in self._timed:
            self._timed[key] = first_is_faster(first, second, repeats)
        return self._timed[key]

    @property
    def source(self) -> str:
        """Where this start's choices came from, for the log."""
        if not self._timed:
            return f"cached in {self.path}"
        read = f", {self._num_read} read" if self._num_read else ""
        return f"{len(self._timed)} timed now{read}; saved to {self.path}"

    def save(self) -> None:
        """Add the choices timed now to the file (keeping what other starts saved there for
        other shapes). Warns and goes on where it cannot be written: the next start times them
        again."""
        if not self._timed:
            return
        choices = {**self._read(warn=False), **self._timed}
        text = json.dumps({"machine": _machine(), "choices": choices}, indent=1, sort_keys=True)
        try:
            with replacing(self.path) as scratch:
                (scratch / self.path.name).write_text(text + "\n")
        except OSError as e:
            logger.warning("kernel choices not saved to %s (%s)", self.path, e)

    def _read(self, warn: bool) -> dict[str, bool]:
        try:
            data = json.loads(self.path.read_text())
            choices = data["choices"]
            if not all(isinstance(v, bool) for v in choices.values()):
                raise TypeError("a choice that is not true or false")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            if warn:
                logger.warning(
                    "kernel choices %s unreadable (%s: %s): treated as absent, timed again",
                    self.path, type(e).__name__, e,
                )  # fmt: skip
            return {}
        return choices
