"""Incremental detokenization: each new token's text, as soon as it is valid UTF-8."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the stream first, so the first output token decodes in context (a
# leading space or a byte sequence that started in the prompt comes out right).
_NUM_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend
        if backend is not None:
            context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        else:
            self._token_ids: list[int] = []
            self._text = ""

    def step(self, token_id: int) -> str:
        """Text that ``token_id`` completes (may be empty while a multi-byte char is open)."""
        if self._backend is not None:
            return self._stream.step(self._backend, token_id) or ""
        self._token_ids.append(token_id)
        text = self._tokenizer.decode(
            self._token_ids, skip_special_tokens=self._skip_special_tokens
        )
        if text.endswith("\ufffd"):
            return ""
        new, self._text = text[len(self._text) :], text
        return new
