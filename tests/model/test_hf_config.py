"""``read_hf_config`` against the reference, transformers' ``AutoConfig``: the same
``ModelConfig`` for every tiny model, the built-in model, each optional key left out of
``config.json`` in turn (the config classes' defaults), and Qwen2's sliding-window settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer, Qwen2Config

from pagedkv.model.config import ModelConfig
from pagedkv.model.hf_config import read_hf_config, tokenizer_routing_config
from tests.tiny_models import CONFIGS, TINY, build_tokenizer

DEFAULT_MODEL = Path(__file__).parents[2] / "pagedkv" / "assets" / "default_model"
# Keys a config.json may leave out: the config class then supplies them.
OPTIONAL = (
    "rms_norm_eps", "max_position_embeddings", "num_key_value_heads", "head_dim", "hidden_act",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "rope_parameters", "rope_theta", "rope_scaling",
    "vocab_size", "intermediate_size", "dtype", "torch_dtype",
)  # fmt: skip


def assert_read_as_transformers_does(directory: Path) -> None:
    ours = ModelConfig.from_hf_config(read_hf_config(directory))
    assert ours == ModelConfig.from_hf_config(AutoConfig.from_pretrained(directory))


def saved(directory: Path, config) -> Path:
    config.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_tiny_model_reads_as_transformers_does(tmp_path: Path, name: str) -> None:
    directory = saved(tmp_path, CONFIGS[name]())
    assert_read_as_transformers_does(directory)
    full = json.loads((directory / "config.json").read_text())
    for key in OPTIONAL:
        if key not in full:
            continue
        trimmed = {k: v for k, v in full.items() if k != key}
        (directory / "config.json").write_text(json.dumps(trimmed))
        assert_read_as_transformers_does(directory)
    (directory / "config.json").write_text(json.dumps(full))


def test_the_built_in_model_reads_as_transformers_does() -> None:
    assert_read_as_transformers_does(DEFAULT_MODEL)


@pytest.mark.parametrize("use_sliding_window", [False, True])
@pytest.mark.parametrize("max_window_layers", [0, 1, 3])
def test_qwen2_windows_per_layer(tmp_path: Path, use_sliding_window, max_window_layers) -> None:
    config = Qwen2Config(
        **TINY,
        num_hidden_layers=3,
        use_sliding_window=use_sliding_window,
        sliding_window=8,
        max_window_layers=max_window_layers,
    )
    directory = saved(tmp_path, config)
    raw = json.loads((directory / "config.json").read_text())
    raw.pop("layer_types")  # derived from the other three, as transformers derives it
    (directory / "config.json").write_text(json.dumps(raw))
    assert_read_as_transformers_does(directory)


def test_bad_config_files_are_value_errors_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json does not exist"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; supported: llama"):
        read_hf_config(tmp_path)


def test_the_tokenizer_is_the_one_autotokenizer_picks_alone(tmp_path: Path) -> None:
    """Given our routing config, ``AutoTokenizer`` picks the class it picks from the model's
    own config, and tokenizes alike."""
    build_tokenizer(saved(tmp_path, CONFIGS["qwen2"]()), vocab_size=TINY["vocab_size"])
    for directory in (DEFAULT_MODEL, tmp_path):
        ours = AutoTokenizer.from_pretrained(directory, config=tokenizer_routing_config(directory))
        reference = AutoTokenizer.from_pretrained(directory)
        assert type(ours) is type(reference)
        text = "def add(a, b):\n    return a + b  w1 w2"
        assert ours(text).input_ids == reference(text).input_ids
    assert tokenizer_routing_config(tmp_path / "missing") is None
