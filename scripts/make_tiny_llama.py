"""A small random-weight Llama that tensor parallelism can split, with the built-in model's
tokenizer (so text prompts work; the answers are noise).

The built-in model has 3 attention heads and 512 MLP features, which no tensor-parallel size
divides; this one has 8 heads (4 KV heads), 688 features and 4 layers, like the HF-peer
benchmark's Llama (19M parameters with its 32k vocabulary, 3M here with 4096 tokens).

    python scripts/make_tiny_llama.py /tmp/tiny-llama
    pagedkv generate --model /tmp/tiny-llama -tp 2 "def add(a, b):"
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv.engine.engine_args import DEFAULT_MODEL_PATH


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUTPUT_DIR")
    out = Path(sys.argv[1])
    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEFAULT_MODEL_PATH / name, out / name)
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
