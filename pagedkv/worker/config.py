"""WorkerConfig: the engine arguments the model runner reads (``EngineArgs.create_worker_config``
builds it, their ranges checked)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkerConfig:
    model_path: Path
    #: ``auto`` or unset values are resolved by the runner (``resolve.py``).
    dtype: str
    device: str
    max_model_len: int | None
    generation_config: str
    #: None: torch on CPU, triton on CUDA.
    attention_backend: str | None
    enforce_eager: bool
    retune_kernels: bool
    #: Rows of the input batch.
    max_num_seqs: int
    #: Seeds torch's default generator, which unseeded sampling draws from (None: not seeded).
    seed: int | None
    gpu_memory_utilization: float
    #: ``--cpu-cores``: the cores this instance's threads run on (None: as
    #: ``VLLM_CPU_OMP_THREADS_BIND`` says, else unpinned); ``cpu_binding.bind_cpu_cores``.
    cpu_cores: str | None = None
