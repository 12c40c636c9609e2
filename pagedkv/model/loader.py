"""Build a model from a local Hugging Face directory: config.json plus safetensors weights."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedkv.distributed.tp_group import SINGLE_RANK, TPGroup
from pagedkv.model.config import ModelConfig
from pagedkv.model.hf_config import read_hf_config
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.registry import get_model_class


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shards named by ``model.safetensors.index.json``, else every ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one tensor at a time, so loading never holds a second copy."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                yield name, f.get_tensor(name)


def _materialize_parameters(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace the meta parameters by uninitialised real ones that the checkpoint will fill."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            real = torch.empty(param.shape, dtype=dtype, device=device)
            setattr(module, name, nn.Parameter(real, requires_grad=False))


def load_model(
    model_path: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    tp: TPGroup = SINGLE_RANK,
) -> LlamaForCausalLM:
    """Load the model in ``model_path`` (a local directory), in eval mode without gradients:
    rank ``tp.rank``'s shard of it (``tensor_parallel.ModelShards``), each checkpoint tensor
    narrowed to that rank's part as it is copied.

    ``dtype`` defaults to the checkpoint's ``dtype`` (fp32 when it names none). ValueError when
    ``tp.world_size`` cannot share the model's heads or intermediate features.
    """
    model_dir = Path(model_path)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    hf_config = read_hf_config(model_dir)
    model_cls = get_model_class(getattr(hf_config, "architectures", None) or [])
    config = ModelConfig.from_hf_config(hf_config, dtype)
    with torch.device("meta"):
        model = model_cls(config, tp)
    _materialize_parameters(model, config.dtype, torch.device(device))
    model.load_weights(iterate_weights(model_dir))
    return model.to(device).eval()
