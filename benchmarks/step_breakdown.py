"""Where a decode step's time goes, and the GEMM-only floor of a run (for ``throughput.py``).

``decode_breakdown``: with every request of the workload decoding at once, each step's wall
time (unprofiled), and from a profiled stretch of steps the time in GEMMs (``aten::mm`` /
``addmm``) and in the attention backend's ``forward``; "other" is the rest (norms, RoPE,
activations, residual adds, KV writes, sampling, scheduling, output processing).

``gemm_floor``: the same GEMM shapes a run executed, replayed back to back on random inputs:
the time that run would take if it did nothing but its matrix products.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

GEMM_OPS = ("aten::mm", "aten::addmm")


def _profile(fn: Callable[[], object]) -> profile:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return prof


def _gemm_shapes(prof: profile) -> Counter:
    """(rows, inner, cols) of every top-level GEMM the profiled code ran, with counts."""
    shapes: Counter = Counter()
    for event in prof.events():
        if event.name not in GEMM_OPS:
            continue
        dims = [d for d in event.input_shapes if len(d) == 2]
        (m, k), (_, n) = dims[-2], dims[-1]  # addmm's bias comes first
        shapes[(m, k, n)] += 1
    return shapes


def _event_ms(prof: profile, names: tuple[str, ...]) -> float:
    return sum(e.cpu_time_total for e in prof.events() if e.name in names) / 1e3


def replay_gemms(shapes: Counter, dtype: torch.dtype, repeats: int = 5) -> float:
    """Seconds to run every GEMM in ``shapes`` (count times each), medians of ``repeats``."""
    total = 0.0
    for (m, k, n), count in shapes.items():
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        torch.mm(a, b)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        total += count * statistics.median(times)
    return total


def gemm_floor(run: Callable[[], object], dtype: torch.dtype) -> tuple[float, Counter]:
    """Profile one ``run`` for its GEMM shapes, replay them: ``(floor seconds, shapes)``."""
    shapes = _gemm_shapes(_profile(run))
    return replay_gemms(shapes, dtype), shapes


def decode_breakdown(llm, prompts: list[list[int]], params, num_steps: int = 12) -> dict:
    """ms per decode step with all ``prompts`` decoding together: the unprofiled median step,
    GEMM and attention (from profiled steps), other (the rest), and the GEMM-only floor of those
    steps' shapes."""
    engine = llm.llm_engine
    engine.reset_prefix_cache()
    ids = [engine.add_request(None, p, params) for p in prompts]
    decoding: set[str] = set()
    while len(decoding) < len(ids):  # step through the prefills
        for out in engine.step():
            if out.outputs[0].token_ids:
                decoding.add(out.request_id)
    step_times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)

    backend = engine.model_runner.attn_backend
    forward = backend.forward

    def traced_forward(*args, **kwargs):
        with record_function("attention"):
            return forward(*args, **kwargs)

    backend.forward = traced_forward
    try:
        prof = _profile(lambda: [engine.step() for _ in range(num_steps)])
    finally:
        del backend.forward  # back to the class's method
    engine.abort_request(ids)
    total = statistics.median(step_times) * 1e3
    gemm = _event_ms(prof, GEMM_OPS) / num_steps
    attention = _event_ms(prof, ("attention",)) / num_steps
    floor = replay_gemms(_gemm_shapes(prof), llm.llm_engine.model_runner.dtype) / num_steps
    return dict(
        batch=len(prompts),
        step_ms=total,
        gemm_ms=gemm,
        attention_ms=attention,
        # The unprofiled step less the profiled parts: the profiler's own cost (tens of
        # microseconds per op with shapes recorded) would otherwise count as "other".
        other_ms=total - gemm - attention,
        gemm_floor_ms=floor * 1e3,
    )
