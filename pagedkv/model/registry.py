"""Model classes by Hugging Face architecture name."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.qwen2 import Qwen2ForCausalLM

_MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODEL_CLASSES)


def get_model_class(architectures: Sequence[str]) -> type[LlamaForCausalLM]:
    """The class of the first supported name in ``architectures`` (a config's list)."""
    for name in architectures:
        if name in _MODEL_CLASSES:
            return _MODEL_CLASSES[name]
    raise ValueError(
        f"unsupported architecture {', '.join(architectures) or '(none given)'}; supported: "
        + ", ".join(supported_architectures())
    )
