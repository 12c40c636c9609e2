"""The compiled one-row GEMV against a float64 product, and the modules that use it."""

from __future__ import annotations

import platform

import pytest
import torch

from pagedkv.model.cpu_gemv import CpuGemv, attach, load_cpu_gemv
from pagedkv.model.linear import Linear
from pagedkv.model.lm_head import LMHead


@pytest.fixture(scope="module")
def gemv() -> CpuGemv:
    loaded = load_cpu_gemv()
    assert loaded is not None, "the machine has a C++ compiler: the kernels must build"
    return loaded


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _assert_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> None:  # fmt: skip
    """``out`` is ``x @ weight + bias`` up to fp32 rounding of a sum of K + 1 terms in any
    order: within (K + 1) * 2^-24 of the sum of the terms' magnitudes."""
    exact = x.double() @ weight.double()
    magnitude = x.double().abs() @ weight.double().abs()
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    bound = (weight.shape[0] + 1) * 2.0**-24 * magnitude
    assert out.dtype is torch.float32
    assert bool(((out.double() - exact).abs() <= bound).all()), (out - exact).abs().max()


# Inputs: 1, below a vector, one vector, past it; outputs: partial vectors and tiles, a tile of
# 128, several tiles with a ragged end, and shapes past the threads' threshold (K * N >= 2^15).
SHAPES = [(1, 1), (7, 5), (16, 16), (33, 130), (64, 128), (256, 256), (256, 1376), (688, 257)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_input_major_equals_the_product(gemv, k: int, n: int, with_bias: bool,
                                        threads: int) -> None:  # fmt: skip
    x, weight = _randn(1, k, seed=k), _randn(k, n, seed=n)
    bias = _randn(n, seed=k + n) if with_bias else None
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = gemv.input_major(x, weight, bias)
    finally:
        torch.set_num_threads(previous)
    assert out.shape == (1, n)
    _assert_product(out, x, weight, bias)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("k", "n"), [*SHAPES, (256, 32000), (48, 1003)])
def test_output_major_equals_the_product(gemv, k: int, n: int, threads: int) -> None:
    """Rows in groups of 8 (a ragged last group), each thread its own run of groups."""
    x, weight = _randn(1, k, seed=k), _randn(n, k, seed=n)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = gemv.output_major(x, weight)
    finally:
        torch.set_num_threads(previous)
    _assert_product(out, x, weight.t(), None)


def test_bad_operands_are_refused_before_a_pointer_crosses(gemv) -> None:
    weight = _randn(8, 4, seed=0)
    for x in (_randn(2, 8, seed=1), _randn(1, 9, seed=1), _randn(1, 8, seed=1).double(),
              _randn(8, 2, seed=1).t()[:1]):  # fmt: skip
        with pytest.raises(ValueError, match="one contiguous fp32 CPU row of 8"):
            gemv.input_major(x, weight, None)
    x = _randn(1, 8, seed=1)
    with pytest.raises(ValueError, match="bias must have shape"):
        gemv.input_major(x, weight, _randn(5, seed=2))
    with pytest.raises(ValueError, match="weights must be"):
        gemv.input_major(x, weight.t(), None)  # not contiguous
    with pytest.raises(ValueError, match="one contiguous fp32 CPU row of 4"):
        gemv.output_major(x, weight)


@pytest.mark.parametrize("gemv_by_vocab", [True, False])
def test_linear_and_the_lm_head_use_it_for_one_row_only(gemv, gemv_by_vocab: bool) -> None:
    """Attached, one fp32 row goes through the kernel (Linear's weight, the head's layout that
    ``choose_gemv_layout`` picked); batches, and rows it does not take, keep torch's path. Same
    values either way."""
    linear, head = Linear(48, 100, bias=True), LMHead(48, 1000)
    with torch.no_grad():
        for p in (*linear.parameters(), head.weight):
            p.copy_(_randn(*p.shape, seed=p.numel()))
    head.prepare()
    rows = {n: _randn(n, 48, seed=n) for n in (1, 3)}
    plain = {n: (linear(x), head(x)) for n, x in rows.items()}
    assert attach(torch.nn.Sequential(linear, head), gemv) == 2
    head.gemv_by_vocab = gemv_by_vocab
    calls: list[str] = []
    for name in ("input_major", "output_major"):
        kernel = getattr(gemv, name)
        setattr(gemv, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    try:
        for n, x in rows.items():
            for a, b in zip((linear(x), head(x)), plain[n]):
                torch.testing.assert_close(a, b)
        linear(rows[1].double().float()[:, :48])  # a contiguous copy: still one row
    finally:
        del gemv.input_major, gemv.output_major
    head_kernel = "output_major" if gemv_by_vocab else "input_major"
    assert calls == ["input_major", head_kernel, "input_major"]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="-mno-avx512f is an x86 flag")
def test_the_portable_loops_without_avx512_equal_the_product(tmp_path) -> None:
    """The same source built without AVX-512 (the plain C++ loops other CPUs run)."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    import pagedkv

    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler is not None, "the machine has a C++ compiler"
    source = Path(pagedkv.__file__).parent / "csrc" / "gemv.cpp"
    library = tmp_path / "gemv_portable.so"
    subprocess.run(
        [compiler, "-O3", "-march=native", "-mno-avx512f", "-ffast-math", "-fopenmp", "-fPIC",
         "-std=c++17", "-shared", str(source), "-o", str(library)],
        check=True, timeout=120,
    )  # fmt: skip
    portable = CpuGemv(ctypes.CDLL(str(library)))
    for k, n in [(7, 5), (33, 130), (256, 1376), (688, 257)]:
        x, weight, bias = _randn(1, k, seed=k), _randn(k, n, seed=n), _randn(n, seed=1)
        _assert_product(portable.input_major(x, weight, bias), x, weight, bias)
        by_output = weight.t().contiguous()
        _assert_product(portable.output_major(x, by_output), x, weight, None)
