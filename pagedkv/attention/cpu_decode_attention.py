"""The compiled CPU decode kernel (``csrc/paged_decode.cpp``): built once per machine, cached.

Decode attention on CPU is memory-bound: the torch path gathers each decode's blocks into a
scratch copy, then runs SDPA over the copy, so every key and value is read twice and written
once, in about ten small calls per layer. The kernel reads them once, in place, through the
block table, in one parallel region per layer (64 decodes of 350 tokens: 6.8 vs 12.3 ms per
layer on one core of this project's CPU; on two cores shared with other jobs 16 vs 128 ms).

It is compiled with the machine's C++ compiler on first use (about a minute on two cores) and
cached by torch under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), keyed by
the source, the flags and this CPU's instruction sets, so later starts load it in milliseconds.
When no compiler is available the torch path is used, with one warning.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# -ffast-math lets the compiler vectorise exp (glibc's libmvec); scores and sums stay fp32.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

PagedDecode = Callable[..., None]
_loaded: dict[str, PagedDecode | None] = {}


def _cpu_fingerprint() -> str:
    """A short hash of this CPU's model and flags: -march=native code is only valid here."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:12]


def load_paged_decode() -> PagedDecode | None:
    """The kernel ``paged_decode(out, query, kv_cache, token_indices, block_table, seq_lens,
    first_keys, scale)``, or None when it cannot be built here (warned once per process)."""
    name = f"pagedkv_paged_decode_{_cpu_fingerprint()}"
    if name in _loaded:
        return _loaded[name]
    from torch.utils import cpp_extension

    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name,
            [str(_SOURCE)],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as e:
        logger.warning(
            "the CPU decode kernel could not be built (%s); decode attention gathers blocks "
            "and runs SDPA instead",
            str(e).splitlines()[0] if str(e) else type(e).__name__,
        )
        _loaded[name] = None
        return None
    logger.info("CPU decode kernel ready in %.1f s (%s)", time.perf_counter() - start, name)
    _loaded[name] = module.paged_decode
    return module.paged_decode
