"""Incremental detokenization: each new token's text, as soon as it is valid UTF-8.

Bytes that never complete a character (a model can emit any byte token) are held back while
the request runs and come out at the end as U+FFFD, as ``tokenizer.decode`` renders them, so a
finished request's text equals the decode of its token ids."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the stream first, so the first output token decodes in context (a
# leading space or a byte sequence that started in the prompt comes out right).
_NUM_CONTEXT_TOKENS = 6


def _clean_context(tokenizer, prompt_token_ids: Sequence[int], skip: bool) -> list[int]:
    """The last prompt tokens, cut back to end on a whole character: a prompt ending in bytes
    that complete no character would otherwise have them come out as the first output text."""
    context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
    while context and tokenizer.decode(context, skip_special_tokens=skip).endswith("\ufffd"):
        context.pop()
    return context


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend
        #: The tokens before the held ones (decoding context), and those not yet shown as text.
        self._context = _clean_context(tokenizer, prompt_token_ids, skip_special_tokens)
        self._held: list[int] = []
        if backend is not None:
            self._stream = DecodeStream(ids=self._context, skip_special_tokens=skip_special_tokens)
        else:
            self._token_ids: list[int] = []
            self._text = ""

    def step(self, token_id: int) -> str:
        """Text that ``token_id`` completes (may be empty while a multi-byte char is open)."""
        self._held.append(token_id)
        text = self._step(token_id)
        if text:
            self._context = (self._context + self._held)[-_NUM_CONTEXT_TOKENS:]
            self._held = []
        return text

    def flush(self) -> str:
        """At the end of the request: the text of the tokens still held back."""
        if not self._held:
            return ""
        held, self._held = self._held, []
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        context = decode(self._context, skip_special_tokens=skip)
        text = decode(self._context + held, skip_special_tokens=skip)
        if text.startswith(context):
            return text[len(context) :]
        return decode(held, skip_special_tokens=skip)

    def _step(self, token_id: int) -> str:
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
