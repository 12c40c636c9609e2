"""The scheduler's configuration (frozen: derived values are computed, never patched)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        """The ranges are ``EngineArgs``'; this is what needs the model's ``max_model_len``."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}) so every prompt fits one step"
            )
