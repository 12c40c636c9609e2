"""WorkerConfig: what the model runner reads (built by ``EngineArgs.create_worker_config``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkerConfig:
    model_path: Path
    dtype: str = "auto"
    device: str = "auto"
    seed: int | None = 0
    #: None: the checkpoint's ``max_position_embeddings``.
    max_model_len: int | None = None
    #: Rows of the persistent batch (the scheduler's ``max_num_seqs``).
    max_num_seqs: int = 256
    #: None: ``torch`` on CPU, ``triton`` on CUDA.
    attention_backend: str | None = None
    enforce_eager: bool = False
    retune_kernels: bool = False
    generation_config: str = "auto"
    #: The fraction of the whole GPU the engine may use (vLLM's meaning).
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
