"""The model's Hugging Face tokenizer, as every part of pagedkv loads it."""

from __future__ import annotations

import logging
import os
from typing import Any

from pagedkv.model.hf_config import tokenizer_routing_config

logger = logging.getLogger(__name__)


def load_hf_tokenizer(path: str | os.PathLike[str]) -> Any:
    """``AutoTokenizer`` for ``path``, its class picked from the model's config
    (``tokenizer_routing_config``), with no length limit of its own: the engine checks each
    prompt against ``max_model_len`` and refuses an over-long one with a clean error, so the
    warning transformers logs when a text encodes past the tokenizer's ``model_max_length``
    ("Token indices sequence length is longer than ...") would only mislead. Raises what
    ``from_pretrained`` raises (OSError, ValueError, TypeError) where there is no tokenizer."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    return AutoTokenizer.from_pretrained(
        str(path), config=tokenizer_routing_config(path), model_max_length=VERY_LARGE_INTEGER
    )


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The model's tokenizer, or None when the directory has none (token-id prompts only). It
    has encoded and decoded once: a first call costs about a millisecond more than later ones,
    paid here rather than by the first request."""
    try:
        tokenizer = load_hf_tokenizer(path)
    except (OSError, ValueError, TypeError) as e:
        logger.warning("no tokenizer in %s (%s): only token-id prompts will work", path, e)
        return None
    tokenizer.decode(tokenizer.encode("warm up"))
    return tokenizer
