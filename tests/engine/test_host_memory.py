"""Freed activations stay mapped between steps on CPU (``worker/host_memory.py``)."""

from __future__ import annotations

import subprocess
import sys

# Prefill-shaped steps: a 6,600-token chunk through four MLPs of the HF-peer model (its gate/up
# output is 36 MB), the minor page faults of each step printed.
STEPS = """
import resource, sys, torch
from pagedkv.worker.host_memory import keep_freed_host_memory
torch.set_num_threads(2)
if sys.argv[1] == "keep":
    assert keep_freed_host_memory()
    assert keep_freed_host_memory()  # idempotent
x, w1, w2 = torch.randn(6600, 256), torch.randn(256, 1376), torch.randn(688, 256)
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    h = x
    for _ in range(4):
        g = h @ w1
        h = torch.nn.functional.silu(g[:, :688]) * g[:, 688:] @ w2 + h
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_per_step(mode: str) -> list[int]:
    run = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return [int(line) for line in run.stdout.split()]


def test_freed_activations_are_reused_not_faulted_in_again() -> None:
    """Once the heap has grown to a step's peak, later steps fault in little (here 0-6,000 pages
    a step); glibc's defaults map and fault in every block of 32 MB and up again at each step
    (27,000-57,000 pages)."""
    kept, default = faults_per_step("keep"), faults_per_step("default")
    assert 5 * sum(kept[-4:]) <= sum(default[-4:]), (kept, default)
