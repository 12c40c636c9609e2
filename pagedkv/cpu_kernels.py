"""The compiled CPU kernels (``csrc/*.cpp``): one library, built once per machine, cached.

The sources are plain C++ with a C ABI (no torch headers), so the machine's compiler (``$CXX``,
else ``c++``) builds them in a few seconds; the library is cached in ``local_cache.cache_dir()``
by a name hashed from the sources, the flags and this CPU (``-march=native`` code only runs
here). A build is written by ``local_cache.replacing``, so concurrent first starts need no lock
and a killed build leaves nothing half-written behind. Without a compiler the callers use torch
ops, with one warning.
Each kernel's wrapper (``attention/cpu_paged_attention.py``, ``model/cpu_layer_ops.py``)
checks shapes and dtypes before a pointer crosses.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from pagedkv.local_cache import cache_dir, cpu_description, replacing

logger = logging.getLogger(__name__)

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
# -ffast-math lets the compiler vectorise exp (glibc's libmvec) and reorder sums; values stay
# fp32. It is given to the compile step only: linking a shared library with it (GCC < 13) would
# add crtfastmath, which turns on flush-to-zero for the whole process when the library loads.
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
BUILD_TIMEOUT_S = 120.0


def library_path() -> Path:
    """Unique per sources, flags and CPU, so a library under this name is always the right one."""
    sources = [f"{path.name}\n{path.read_text()}" for path in (*_SOURCES, *_HEADERS)]
    key = "\n".join([*sources, *_COMPILE_FLAGS, *_LINK_FLAGS, *cpu_description()])
    return cache_dir() / f"pagedkv_cpu_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def _build(library: Path) -> None:
    """Compile each source and link them into ``library``."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler ($CXX, c++ or g++)")
    with replacing(library) as scratch:
        objects = [str(scratch / f"{source.stem}.o") for source in _SOURCES]
        built = scratch / library.name
        steps = [
            [compiler, *_COMPILE_FLAGS, "-c", str(source), "-o", obj]
            for source, obj in zip(_SOURCES, objects)
        ]
        steps.append([compiler, *_LINK_FLAGS, *objects, "-o", str(built)])
        for argv in steps:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if result.returncode != 0:
                raise OSError(f"{' '.join(argv)} failed: {result.stderr.strip()[:500]}")


_loaded: dict[Path, ctypes.CDLL | None] = {}


def load_cpu_kernels() -> ctypes.CDLL | None:
    """The library, built here on first use; None, warned once per process, when it cannot be
    built or loaded."""
    library = library_path()
    if library in _loaded:
        return _loaded[library]
    handle = None
    try:
        if not library.exists():
            start = time.perf_counter()
            _build(library)
            logger.info("CPU kernels built in %.1f s: %s", time.perf_counter() - start, library)
        handle = ctypes.CDLL(str(library))
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning(
            "the CPU kernels could not be built or loaded (%s); torch ops run instead "
            "(attention gathers blocks and runs SDPA)",
            (str(e).splitlines() or [type(e).__name__])[0],
        )
    _loaded[library] = handle
    return handle
