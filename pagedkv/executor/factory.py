"""The executor for an engine's ranks: one in this process, or a rank per worker config."""

from __future__ import annotations

import logging

from pagedkv.executor.executor import Executor, UniProcExecutor
from pagedkv.executor.multiproc_executor import MultiprocExecutor
from pagedkv.worker.config import WorkerConfig
from pagedkv.worker.model_runner import ModelRunner


def create_executor(configs: list[WorkerConfig]) -> Executor:
    """``configs[r]``: rank r's config (``EngineArgs.create_worker_configs``)."""
    if len(configs) == 1:
        return UniProcExecutor(ModelRunner(configs[0]))
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return MultiprocExecutor(configs, level)
