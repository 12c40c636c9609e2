"""POST /tokenize and /detokenize, in vLLM's shapes."""

from __future__ import annotations

from pagedkv.engine.chat_template import render_chat
from pagedkv.entrypoints.openai.errors import OpenAIError
from pagedkv.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedkv.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """A prompt, or chat messages rendered by the chat template (then tokenized without
        adding special tokens again: the template holds them)."""
        self.check_model(request)
        tokenizer = self._tokenizer()
        if request.messages is not None:
            messages = [m.as_template_dict() for m in request.messages]
            try:
                tokens = render_chat(tokenizer, messages, request.add_generation_prompt)[
                    "prompt_token_ids"
                ]
            except ValueError as e:
                raise OpenAIError(str(e), "messages") from None
        else:
            tokens = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=self.async_llm.max_model_len,
            tokens=tokens,
            token_strs=tokenizer.convert_ids_to_tokens(tokens)
            if request.return_token_strs
            else None,
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request)
        vocab_size = self.async_llm.llm_engine.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(f"tokens must be in [0, {vocab_size}), got {bad[:5]}", "tokens")
        return DetokenizeResponse(prompt=self._tokenizer().decode(request.tokens))

    def _tokenizer(self):
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer")
        return self.tokenizer
