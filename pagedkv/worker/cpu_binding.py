"""An instance's compute threads on its own cores (``--cpu-cores``, ``VLLM_CPU_OMP_THREADS_BIND``),
and a warning when another instance on this host may run on ours.

Binding happens before the model is built: every thread of the process (those that exist now,
one by one, and through inheritance all it starts later: OpenMP's, gloo's, the server's) may run
only on the chosen cores, and torch runs ``len(cores)`` intra-op threads, the count the compiled
kernels read from ``torch.get_num_threads()`` at each call. Two instances on disjoint cores then
never oversubscribe each other.

OpenMP threads are not bound one per core (vLLM's CPU worker binds thread i to core i): each
thread that enters a parallel region owns its own OpenMP team (the warm-up runs on the thread
that builds the engine, the server's steps on the engine thread), and binding a team's first
thread to one core would confine every thread it starts later to that core. Inside the
instance's cores the kernel's scheduler places them.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from pagedkv.worker.co_located import instances_sharing_cores
from pagedkv.worker.cpu_cores import OMP_THREADS_BIND_ENV, format_cpu_list, requested_cores

logger = logging.getLogger(__name__)


def pin_process(cores: tuple[int, ...]) -> None:
    """Every thread of this process (and so every thread it starts later) on ``cores``;
    ``len(cores)`` torch threads."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended since the listing
            os.sched_setaffinity(int(task), cores)
    torch.set_num_threads(len(cores))


def bind_cpu_cores(cpu_cores: str | None, check_neighbours: bool = True) -> tuple[int, ...] | None:
    """Pins this process as ``--cpu-cores`` (``cpu_cores``) or ``VLLM_CPU_OMP_THREADS_BIND``
    ask (ValueError for a bad list); the cores pinned to, or None. With ``check_neighbours``,
    warns once when another pagedkv instance on this host may run on the cores we run on."""
    request = requested_cores(cpu_cores)
    if request.cores is not None:
        pin_process(request.cores)
        logger.info(
            "pinned to cores %s (%d threads, %s)",
            format_cpu_list(request.cores),
            len(request.cores),
            request.source,
        )
    if check_neighbours and hasattr(os, "sched_getaffinity"):
        warn_if_sharing_cores(request.cores or tuple(os.sched_getaffinity(0)))
    return request.cores


def warn_if_sharing_cores(cores: tuple[int, ...]) -> None:
    """One WARNING naming the other instances that may run on ``cores`` and the cores shared."""
    neighbours = instances_sharing_cores(cores)
    if not neighbours:
        return
    others = ", ".join(f"pid {n.pid} (cores {format_cpu_list(n.shared_cores)})" for n in neighbours)
    logger.warning(
        "this instance shares cores with other pagedkv instances on this host: %s. Instances "
        "that share cores slow each other down far more than their share (their OpenMP "
        "threads oversubscribe the cores): give each its own with --cpu-cores (or %s), e.g. "
        "--cpu-cores 0-3 for one and --cpu-cores 4-7 for the other",
        others,
        OMP_THREADS_BIND_ENV,
    )
