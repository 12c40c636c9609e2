"""What the engine arguments left to ``auto`` (device, dtype) or unset (``max_model_len``)
resolve to, on this machine and for this checkpoint."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (exact, and fast without bf16 units); on GPU the checkpoint's
    16-bit dtype, or bfloat16 for a float32 checkpoint."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return checkpoint_dtype if checkpoint_dtype != torch.float32 else torch.bfloat16


def resolve_max_model_len(asked: int | None, max_position_embeddings: int) -> int:
    """The context length: the model's unless asked for less (more is refused, as in vLLM:
    positions past what the model was built for give garbage)."""
    if asked is None:
        return max_position_embeddings
    if asked > max_position_embeddings:
        raise ValueError(
            f"max_model_len {asked} is larger than the model's max_position_embeddings "
            f"({max_position_embeddings})"
        )
    return asked
