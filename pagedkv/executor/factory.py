"""The executor for an engine's ranks: one in this process, or a rank per worker config."""

from __future__ import annotations

import logging

from pagedkv.executor.executor import Executor, UniProcExecutor
from pagedkv.executor.multiproc_executor import MultiprocExecutor
from pagedkv.model.config import ModelConfig
from pagedkv.model.tensor_parallel import ModelShards
from pagedkv.worker.config import WorkerConfig
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.resolve import resolve_device


def create_executor(configs: list[WorkerConfig]) -> Executor:
    """``configs[r]``: rank r's config (``EngineArgs.create_worker_configs``)."""
    if len(configs) == 1:
        return UniProcExecutor(ModelRunner(configs[0]))
    check_tensor_parallel(configs[0], len(configs))
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return MultiprocExecutor(configs, level)


def check_tensor_parallel(config: WorkerConfig, tp_size: int) -> None:
    """Before any rank starts: CPU ranks, and a model ``tp_size`` ranks can split (ValueError
    naming what does not fit, instead of the same error from every rank)."""
    if resolve_device(config.device).type != "cpu":
        raise ValueError(
            "tensor_parallel_size > 1 runs CPU ranks (shared memory and gloo); CUDA ranks "
            "(NCCL) are not built yet: use --device cpu"
        )
    ModelShards.of(ModelConfig.from_pretrained(config.model_path), 0, tp_size)
