"""Tiny random-weight Hugging Face checkpoints for tests (no hub: built and saved locally).

Weights use ``initializer_range=0.2`` (and randomised norms/biases): with the default 0.02 the
logits are nearly flat, a rounding difference can flip a greedy token, and a real bug can hide
behind "close enough". With 0.2 greedy paths are decisive, so token-for-token equality against
transformers is a sharp test.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

WINDOW = 8
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(**TINY, num_hidden_layers=2),
    "llama_tied_llama3": lambda: LlamaConfig(
        **TINY,
        num_hidden_layers=2,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_linear_head_dim": lambda: LlamaConfig(
        **TINY,
        num_hidden_layers=2,
        head_dim=24,
        attention_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0},
    ),
    "qwen2": lambda: Qwen2Config(**TINY, num_hidden_layers=2),
    "mistral_window": lambda: MistralConfig(**TINY, num_hidden_layers=2, sliding_window=WINDOW),
    "qwen2_hybrid": lambda: Qwen2Config(
        **TINY,
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    ),
}


def build_checkpoint(directory: Path, config: PretrainedConfig, **save_kwargs: object) -> None:
    """Save a random model; norm weights and biases are randomised too, so loading them counts."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(directory, **save_kwargs)


def build_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose token ``i`` is the word ``w{i}``: text round-trips exactly
    (``"w5 w17"``), so stop strings and detokenization can be tested on a random model."""
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(directory)


def random_prompt(length: int, seed: int, vocab_size: int = TINY["vocab_size"]) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=gen).tolist()
