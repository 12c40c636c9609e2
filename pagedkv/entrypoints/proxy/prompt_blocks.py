"""A request's prompt as the instances will see it: token ids, and the block hashes each
instance's prefix cache looks up.

The proxy tokenizes as ``pagedkv serve`` does: a completion's text with the tokenizer's special
tokens, token ids as given; a chat's messages through the chat template (generation prompt
added, no special tokens added again). It hashes with the instance's own algorithm and block
size (``BlockHasher``: chained, seeded alike in every process), so the hashes are the ones the
instance computed. A hit is looked up in the first ``n - 1`` tokens only: an instance never
serves the last prompt token from its cache (it must compute it for the logits)::

    n = 33, block_size 16:  | block 0 | block 1 |x|    hit at most 16 tokens, though the
                                               ^ token 32, always computed      prompt
                                                                                caches 2 blocks

A body the proxy cannot read this way (a batch of prompts, an unknown message form, a template
error) gets no prediction: the instance answers it, or says what is wrong with it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from pagedkv.kv_cache.block_hash import BlockHash, BlockHasher
from pagedkv.model.tokenizer import load_hf_tokenizer

logger = logging.getLogger(__name__)


class PromptTokenizer:
    def __init__(self, tokenizer_path: str | Path) -> None:
        try:
            self.tokenizer = load_hf_tokenizer(tokenizer_path)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"--tokenizer {tokenizer_path}: no tokenizer there: {e}") from None
        self._hashers: dict[tuple[int, str], BlockHasher] = {}

    def token_ids(self, path: str, body: dict) -> list[int] | None:
        """The prompt's token ids, or None when the proxy cannot tell them."""
        try:
            if path == "/v1/chat/completions":
                return self._chat(body.get("messages"))
            return self._completion(body.get("prompt"))
        except Exception as e:  # a template or tokenizer error: the instance will say
            logger.debug("no routing prediction for this request: %s", e)
            return None

    def _completion(self, prompt: object) -> list[int] | None:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # OpenAI's batch form, of one prompt
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        return None

    def _chat(self, messages: object) -> list[int] | None:
        if not isinstance(messages, list) or not messages:
            return None
        rendered = []
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                return None
            content = message.get("content")
            if isinstance(content, list):  # text parts
                if not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
                    return None
                content = "".join(part["text"] for part in content)
            elif content is not None and not isinstance(content, str):
                return None
            entry = {"role": message["role"], "content": content or ""}
            if isinstance(message.get("name"), str):
                entry["name"] = message["name"]
            rendered.append(entry)
        text = self.tokenizer.apply_chat_template(
            rendered, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def block_hashes(
        self, token_ids: Sequence[int], block_size: int, algo: str, cache_salt: str | None = None
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``token_ids``, as an instance hashing with (``algo``,
        ``block_size``) computes them."""
        hasher = self._hashers.get((block_size, algo))
        if hasher is None:
            hasher = self._hashers[(block_size, algo)] = BlockHasher(block_size, algo)
        return hasher.hash_token_ids(token_ids, cache_salt)
