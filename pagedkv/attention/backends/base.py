"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from pagedkv.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Writes a step's keys/values into the paged cache and attends over it.

    One instance per model runner: a backend may keep scratch state between layers.
    """

    name: ClassVar[str]

    @abstractmethod
    def check_device(self, device: torch.device) -> None:
        """ValueError if this backend cannot run on ``device`` (asked before the model loads)."""

    def load_kernels(self, device: torch.device) -> None:
        """Build or load compiled kernels for ``device`` (skipped under ``--enforce-eager``);
        a backend without any keeps this no-op."""
        return None

    @abstractmethod
    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
