"""Where a decode step's time goes, and the GEMM-only floor of a run (for ``throughput.py``).

``decode_breakdown``: with every request of the workload decoding at once, each step's wall
time, the time in GEMMs (every ``Linear``) and in the attention backend's ``forward``; "other"
is the rest (norms, RoPE, activations, residual adds, KV writes, sampling, scheduling, output
processing).

``record_run`` and ``replay_gemms``: the GEMM shapes a run executed, replayed back to
back on random inputs, each through the fastest GEMM available for it: the time that run would
take if it did nothing but its matrix products (its GEMM-only floor).

``record_run`` also counts the bytes of K and V the run's attention read at the least (each key
and value a query attends to, once per layer call); ``streaming_read_bandwidth`` is what this
machine reads from memory per second. Their quotient is the run's KV-read floor: attention over
a cache larger than the last-level cache cannot take less.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np
import torch

from pagedkv.engine.request_input import RequestInput


class _Timed:
    """Wraps a callable, adding up its wall time."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        return out


@contextlib.contextmanager
def recording_gemms() -> Iterator[tuple[Counter, _Timed]]:
    """While open, every ``Linear`` and ``LMHead`` product (MKL's, oneDNN's or the compiled
    one-row GEMV) is timed and its ``(rows, inner, cols)`` counted: ``(shapes, timer)``. A
    decoder layer run in one compiled call (``cpu_decode_layer``) has its projections counted,
    not timed (the call's time is the whole layer's)."""
    from pagedkv.model.cpu_decode_layer import CpuDecodeLayer
    from pagedkv.model.linear import Linear
    from pagedkv.model.lm_head import LMHead

    shapes: Counter = Counter()
    forwards = {cls: cls.forward for cls in (Linear, LMHead)}
    one_call = CpuDecodeLayer.__call__

    def gemm(module: Linear, x: torch.Tensor) -> torch.Tensor:
        shapes[(x.shape[0], *module.weight.shape)] += 1
        return forwards[type(module)](module, x)

    def counted_one_call(layer: CpuDecodeLayer, *args):
        for in_features, out_features in layer.projection_shapes:
            shapes[(1, in_features, out_features)] += 1
        return one_call(layer, *args)

    timer = _Timed(gemm)
    for cls in forwards:
        cls.forward = lambda module, x: timer(module, x)
    CpuDecodeLayer.__call__ = counted_one_call
    try:
        yield shapes, timer
    finally:
        for cls, forward in forwards.items():
            cls.forward = forward
        CpuDecodeLayer.__call__ = one_call


def replay_gemms(shapes: Counter, dtype: torch.dtype, repeats: int = 5) -> float:
    """Seconds to run every GEMM in ``shapes`` (count times each), medians of ``repeats``, each
    shape through the fastest GEMM the engine can pick for it: MKL against either weight layout
    (``[k, n]`` or ``[n, k]`` transposed, as ``LMHead`` may use) or, in fp32 where torch has
    oneDNN, oneDNN against a packed weight (``cpu_onednn``)."""
    from pagedkv.model.cpu_onednn import onednn_available, pack_weight, packed_matmul

    total = 0.0
    for (m, k, n), count in shapes.items():
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        b_by_n = b.t().contiguous().t()
        products = [partial(torch.mm, a, b), partial(torch.mm, a, b_by_n)]
        if dtype == torch.float32 and onednn_available():
            products.append(partial(packed_matmul, a, pack_weight(b), None))
        best = float("inf")
        for product in products:
            product()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                product()
                times.append(time.perf_counter() - start)
            best = min(best, statistics.median(times))
        total += count * best
    return total


def kv_bytes_read(kv_cache: torch.Tensor, metadata) -> int:
    """Bytes of K and V one attention call reads at the least: every key and value its queries
    attend to, once (a chunk's last query sees the most: ``seq_len`` keys, or the window's).
    ``kv_cache``: ``[2, num_blocks, block_size, num_kv_heads, head_size]``."""
    per_token = 2 * kv_cache.shape[-2] * kv_cache.shape[-1] * kv_cache.element_size()
    seen = metadata.seq_lens_cpu.astype(np.int64)
    if metadata.sliding_window is not None:
        query_lens = np.diff(metadata.query_start_loc_cpu)
        seen = np.minimum(seen, metadata.sliding_window + query_lens - 1)
    return int(seen.sum()) * per_token


@contextlib.contextmanager
def recording_kv_reads(backend) -> Iterator[list[int]]:
    """While open, ``[bytes]``: the K/V bytes (``kv_bytes_read``) of every call to
    ``backend.forward`` and of every decoder layer run in one compiled call."""
    from pagedkv.model.cpu_decode_layer import CpuDecodeLayer

    total = [0]
    one_call = CpuDecodeLayer.__call__

    def forward(query, kv_cache, metadata, scale):
        total[0] += kv_bytes_read(kv_cache, metadata)
        return type(backend).forward(backend, query, kv_cache, metadata, scale)

    def counted_one_call(layer, hidden_states, residual, cos, signed_sin, kv_cache, metadata):
        total[0] += kv_bytes_read(kv_cache, metadata)
        return one_call(layer, hidden_states, residual, cos, signed_sin, kv_cache, metadata)

    backend.forward = forward
    CpuDecodeLayer.__call__ = counted_one_call
    try:
        yield total
    finally:
        del backend.forward  # back to the class's method
        CpuDecodeLayer.__call__ = one_call


def record_run(run: Callable[[], object], backend) -> tuple[Counter, int]:
    """One ``run``'s GEMMs, ``(rows, inner, cols)`` with counts (what ``replay_gemms`` turns into
    its GEMM-only floor), and the bytes of K and V its attention read at the least."""
    with recording_gemms() as (shapes, _), recording_kv_reads(backend) as kv_bytes:
        run()
    return shapes, kv_bytes[0]


def streaming_read_bandwidth(num_bytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes per second this machine reads from memory on torch's threads: the median time to
    sum a buffer many times the size of any last-level cache (512 MiB), after a first read."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    buffer.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times)


def decode_breakdown(llm, prompts: list[list[int]], params, num_steps: int = 12) -> dict:
    """ms per decode step with all ``prompts`` decoding together: the median step, and over
    those steps the mean time in GEMMs (every ``Linear``, the LM head included), in the
    attention backend's ``forward`` and in the rest; the GEMM-only floor of their shapes and
    their KV-read floor.
    Plain timers around the two calls, not the profiler, whose per-op cost would land on the
    many small ops of attention and "other"."""
    engine = llm.llm_engine
    engine.reset_prefix_cache()
    ids = [engine.add_request(RequestInput(p, params)) for p in prompts]
    decoding: set[str] = set()
    while len(decoding) < len(ids):  # step through the prefills
        for out in engine.step():
            if out.outputs[0].token_ids:
                decoding.add(out.request_id)
    backend = engine.model_runner.attn_backend
    step_times = []
    with recording_gemms() as (shapes, timed_gemm), recording_kv_reads(backend) as kv_bytes:
        attention = _Timed(backend.forward)
        backend.forward = attention
        for _ in range(num_steps):
            start = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - start)
    engine.abort_request(ids)
    mean_step = sum(step_times) / num_steps * 1e3
    gemm_ms = timed_gemm.seconds / num_steps * 1e3
    attention_ms = attention.seconds / num_steps * 1e3
    floor = replay_gemms(shapes, engine.model_runner.dtype) / num_steps
    kv_floor = kv_bytes[0] / num_steps / streaming_read_bandwidth()
    return dict(
        batch=len(prompts),
        step_ms=statistics.median(step_times) * 1e3,
        gemm_ms=gemm_ms,
        attention_ms=attention_ms,
        other_ms=mean_step - gemm_ms - attention_ms,
        gemm_floor_ms=floor * 1e3,
        kv_read_floor_ms=kv_floor * 1e3,
    )
