"""The compiled CPU decode kernel (``csrc/paged_decode.cpp``): built once per machine, cached.

Decode attention on CPU is memory-bound: the torch path gathers each decode's blocks into a
scratch copy, then runs SDPA over the copy, so every key and value is read twice and written
once, in about ten small calls per layer. The kernel reads them once, in place, through the
block table, in one parallel region per layer (64 decodes of 350 tokens: 6.8 vs 12.3 ms per
layer on one core of this project's CPU; on two cores shared with other jobs 16 vs 128 ms).

The source is plain C++ with a C ABI (no torch headers), so the machine's compiler (``$CXX``,
else ``c++``) builds it in about a second; the library is cached under
``$XDG_CACHE_HOME/pagedkv`` (default ``~/.cache/pagedkv``) by a name hashed from the source,
the flags and this CPU (``-march=native`` code only runs here). A build writes a temporary file
and renames it into place, so concurrent first starts need no lock and a killed build leaves
nothing half-written behind. Without a compiler the torch path is used, with one warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# -ffast-math lets the compiler vectorise exp (glibc's libmvec); scores and sums stay fp32. It is
# given to the compile step only: linking a shared library with it (GCC < 13) would add
# crtfastmath, which turns on flush-to-zero for the whole process when the library loads.
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
BUILD_TIMEOUT_S = 120.0
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES = [_PTR] * 7 + [ctypes.c_float] + [_INT] * 7 + [ctypes.c_int]


class PagedDecode:
    """``paged_decode(out, query, kv_cache, token_indices, block_table, seq_lens, first_keys,
    scale)``: writes the decode rows ``token_indices`` of ``out``.

    out, query: ``[num_tokens, num_heads, head_size]``; kv_cache: ``[2, num_blocks, block_size,
    num_kv_heads, head_size]``; all contiguous, of one dtype (fp32, fp16 or bf16).
    token_indices: int64 ``[R]``; block_table: int32 ``[R, max_blocks]``; seq_lens, first_keys:
    int32 ``[R]``: row ``r`` attends to the keys at positions ``[first_keys[r], seq_lens[r])``.
    The C side trusts these shapes: they are checked here, before any pointer crosses.
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {}
        for dtype in _DTYPES:
            function = getattr(library, f"paged_decode_{str(dtype).removeprefix('torch.')}")
            function.argtypes = _ARGTYPES
            function.restype = None
            self._functions[dtype] = function

    def __call__(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        token_indices: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        first_keys: torch.Tensor,
        scale: float,
    ) -> None:
        function = self._functions.get(query.dtype)
        if function is None:
            raise ValueError(f"paged_decode: unsupported dtype {query.dtype}")
        tensors = (out, query, kv_cache, token_indices, block_table, seq_lens, first_keys)
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            raise ValueError("paged_decode: every tensor must be a contiguous CPU tensor")
        if out.dtype != query.dtype or kv_cache.dtype != query.dtype:
            raise ValueError("paged_decode: out, query and kv_cache must share one dtype")
        index_dtypes = (token_indices.dtype, block_table.dtype, seq_lens.dtype, first_keys.dtype)
        if index_dtypes != (torch.int64, torch.int32, torch.int32, torch.int32):
            raise ValueError("paged_decode: token_indices int64; block_table, seq_lens int32")
        num_rows = token_indices.numel()
        if not (block_table.shape[0] == seq_lens.numel() == first_keys.numel() == num_rows):
            raise ValueError("paged_decode: one table row, seq_len and first key per decode")
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        if out.shape != query.shape or query.shape[2] != head_size:
            raise ValueError("paged_decode: query/out shape does not match the cache")
        function(
            out.data_ptr(), query.data_ptr(), kv_cache.data_ptr(), token_indices.data_ptr(),
            block_table.data_ptr(), seq_lens.data_ptr(), first_keys.data_ptr(), scale,
            num_rows, query.shape[1], head_size, num_blocks, block_size, num_kv_heads,
            block_table.shape[1], torch.get_num_threads(),
        )  # fmt: skip


def _library_path() -> Path:
    """Unique per source, flags and CPU, so a library under this name is always the right one."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    cpu = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    key = "\n".join([_SOURCE.read_text(), *_COMPILE_FLAGS, *_LINK_FLAGS, *cpu])
    name = f"paged_decode_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedkv"
    return cache / name


def _build(library: Path) -> None:
    """Compile and link into a temporary file beside ``library``, then rename it into place."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler ($CXX, c++ or g++)")
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        obj, built = Path(scratch) / "paged_decode.o", Path(scratch) / library.name
        for argv in (
            [compiler, *_COMPILE_FLAGS, "-c", str(_SOURCE), "-o", str(obj)],
            [compiler, *_LINK_FLAGS, str(obj), "-o", str(built)],
        ):
            result = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if result.returncode != 0:
                raise OSError(f"{' '.join(argv)} failed: {result.stderr.strip()[:500]}")
        os.replace(built, library)


_loaded: dict[Path, PagedDecode | None] = {}


def load_paged_decode() -> PagedDecode | None:
    """The kernel (``PagedDecode``), built here on first use; None, warned once per process,
    when it cannot be built."""
    library = _library_path()
    if library in _loaded:
        return _loaded[library]
    kernel = None
    try:
        if not library.exists():
            start = time.perf_counter()
            _build(library)
            logger.info(
                "CPU decode kernel built in %.1f s: %s", time.perf_counter() - start, library
            )
        kernel = PagedDecode(ctypes.CDLL(str(library)))
    except (OSError, subprocess.TimeoutExpired, AttributeError) as e:
        logger.warning(
            "the CPU decode kernel could not be built or loaded (%s); decode attention gathers "
            "blocks and runs SDPA instead",
            (str(e).splitlines() or [type(e).__name__])[0],
        )
    _loaded[library] = kernel
    return kernel
