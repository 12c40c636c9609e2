"""A checkpoint's ``config.json`` read without transformers' config classes.

``AutoConfig.from_pretrained`` imports the model's config class, and through it (transformers 5)
``torch.distributed.tensor``: about 1.2 s of CPU at every engine start, for a JSON file. This
reads the file and fills in what the config classes would for the fields ``ModelConfig``
reads: the defaults of each supported ``model_type`` for keys a file leaves out, Qwen2's
per-layer ``layer_types`` and the legacy ``rope_theta`` / ``rope_scaling`` keys (``RopeConfig``
reads both shapes). ``tests/model/test_hf_config.py`` holds it equal to ``AutoConfig`` on every
tiny model, with each optional key left out in turn.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Per model_type: transformers' defaults for the keys ModelConfig reads (configuration_*.py).
_COMMON = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "head_dim": None,
    "num_key_value_heads": None,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "mistral": {
        **_COMMON,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
    },
    "qwen2": {
        **_COMMON,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "layer_types": None,
    },
}


def read_hf_config(model_path: str | os.PathLike[str]) -> SimpleNamespace:
    """``model_path/config.json`` as attributes, completed as transformers completes it (for the
    fields ``ModelConfig`` reads). A ``ValueError`` names a missing file or an unknown
    ``model_type``."""
    path = Path(model_path) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: not a Hugging Face model directory") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    model_type = raw.get("model_type")
    if model_type not in _DEFAULTS:
        raise ValueError(
            f"{path}: unsupported model_type {model_type!r}; supported: {', '.join(_DEFAULTS)}"
        )
    config = {**_DEFAULTS[model_type], **raw}
    if config["num_key_value_heads"] is None:
        config["num_key_value_heads"] = config["num_attention_heads"]
    if model_type == "qwen2":
        if not config["use_sliding_window"]:
            config["sliding_window"] = None
        if config["layer_types"] is None:
            config["layer_types"] = [
                "sliding_attention"
                if config["sliding_window"] is not None and i >= config["max_window_layers"]
                else "full_attention"
                for i in range(config["num_hidden_layers"])
            ]
    return SimpleNamespace(**config)


def tokenizer_routing_config(model_path: str | os.PathLike[str]) -> Any:
    """What ``AutoTokenizer.from_pretrained(path, config=...)`` reads of the model's config to
    pick a tokenizer class (``model_type``, ``tokenizer_class``, the path), without the import
    of the model's config class that it would otherwise make. None without a ``config.json``
    (a tokenizer-only directory): ``AutoTokenizer`` then does as it always does."""
    from transformers import PretrainedConfig

    try:
        raw = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict):
        return None
    routing = {k: raw[k] for k in ("model_type", "tokenizer_class", "model_name") if k in raw}
    return PretrainedConfig(name_or_path=str(model_path), **routing)
