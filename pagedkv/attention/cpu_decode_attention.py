"""The compiled CPU decode kernel (``csrc/paged_decode.cpp``): built once per machine, cached.

Decode attention on CPU is memory-bound: the torch path gathers each decode's blocks into a
scratch copy, then runs SDPA over the copy, so every key and value is read twice and written
once, in about ten small calls per layer. The kernel reads them once, in place, through the
block table, in one parallel region per layer (64 decodes of 350 tokens: 6.8 vs 12.3 ms per
layer on one core of this project's CPU; on two cores shared with other jobs 16 vs 128 ms).

It is compiled with the machine's C++ compiler on first use (about a minute on two cores) and
cached under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) by a name hashed
from the source, the flags, torch's version and this CPU, so later starts import it directly in
milliseconds. When it cannot be built (no compiler, or not within ``BUILD_TIMEOUT_S``), the
torch path is used, with one warning.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# -ffast-math lets the compiler vectorise exp (glibc's libmvec); scores and sums stay fp32.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
# A first build takes about a minute on two idle cores; past this, start without the kernel.
BUILD_TIMEOUT_S = 300.0

PagedDecode = Callable[..., None]
_loaded: dict[str, PagedDecode | None] = {}


def _extension_name() -> str:
    """Unique per source, flags, torch version and CPU (``-march=native`` code only runs
    here), so a built library under this name is always the right one."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    cpu = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    key = "\n".join([_SOURCE.read_text(), " ".join(_CFLAGS), torch.__version__, *cpu])
    return f"pagedkv_paged_decode_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _import_built(name: str, build_dir: Path) -> PagedDecode | None:
    """The kernel from an earlier build, imported without torch's build lock (a process killed
    while holding that lock leaves it behind, and every later ``load`` would wait forever)."""
    library = build_dir / f"{name}.so"
    if not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:  # a library truncated by a killed build: build it again
        return None
    return module.paged_decode


def _build(name: str, build_dir: Path) -> PagedDecode:
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    module = cpp_extension.load(
        name,
        [str(_SOURCE)],
        extra_cflags=_CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )
    return module.paged_decode


def load_paged_decode() -> PagedDecode | None:
    """The kernel ``paged_decode(out, query, kv_cache, token_indices, block_table, seq_lens,
    first_keys, scale)``, or None when it cannot be built here within ``BUILD_TIMEOUT_S``
    (warned once per process)."""
    name = _extension_name()
    if name in _loaded:
        return _loaded[name]
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    kernel = _import_built(name, build_dir)
    if kernel is not None:
        _loaded[name] = kernel
        return kernel
    start = time.perf_counter()
    outcome: dict[str, PagedDecode | BaseException] = {}

    def build() -> None:
        try:
            outcome["kernel"] = _build(name, build_dir)
        except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as e:
            outcome["error"] = e

    # torch's build lock has no timeout: build in a daemon thread and stop waiting after a while.
    thread = threading.Thread(target=build, name="paged-decode-build", daemon=True)
    thread.start()
    thread.join(BUILD_TIMEOUT_S)
    kernel = outcome.get("kernel")
    if kernel is None:
        error = outcome.get("error")
        reason = (
            (str(error).splitlines() or [type(error).__name__])[0]
            if error is not None
            else f"not built within {BUILD_TIMEOUT_S:.0f} s; a stale {build_dir / 'lock'}?"
        )
        logger.warning(
            "the CPU decode kernel could not be built (%s); decode attention gathers blocks "
            "and runs SDPA instead",
            reason,
        )
        _loaded[name] = None
        return None
    logger.info("CPU decode kernel built in %.1f s (%s)", time.perf_counter() - start, build_dir)
    _loaded[name] = kernel  # type: ignore[assignment]
    return kernel  # type: ignore[return-value]
