"""POST /v1/completions: a text or token-id prompt, streamed (SSE) or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi import Response

from pagedkv.engine.async_llm import RequestStream
from pagedkv.engine.outputs import RequestOutput
from pagedkv.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
)
from pagedkv.entrypoints.openai.serving_engine import OpenAIServing

#: OpenAI's default for the legacy completions endpoint.
DEFAULT_MAX_TOKENS = 16
_UNSUPPORTED = ("echo", "suffix", "best_of", "logit_bias")


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest, raw_request: HTTPRequest
    ) -> Response:
        self.check_model(request)
        self.check_unsupported(request, _UNSUPPORTED)
        param_names = self.param_names()
        max_tokens = DEFAULT_MAX_TOKENS if request.max_tokens is None else request.max_tokens
        params = self.sampling_params(request, max_tokens, request.logprobs, param_names)
        request_id = self.request_id(raw_request, "cmpl")
        stream = self.submit(request_id, request.prompt, params, request, param_names)
        return await self.respond(request_id, stream, request, raw_request, param_names)

    def full_response(
        self, request_id: str, final: RequestOutput, request: CompletionRequest
    ) -> CompletionResponse:
        completion = final.outputs[0]
        choice = CompletionChoice(
            text=completion.text,
            logprobs=self._logprobs(completion.token_ids, completion.logprobs, 0),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        return CompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=[choice],
            usage=self.usage(final),
            kv_transfer_params=self.kv_transfer_params(final, request),
        )

    async def stream_chunks(
        self, request_id: str, stream: RequestStream, request: CompletionRequest
    ) -> AsyncIterator[CompletionResponse]:
        text_offset = 0
        final = None
        async for delta in self.deltas(stream):
            final = delta.output
            logprobs = self._logprobs(delta.token_ids, delta.logprobs, text_offset)
            if logprobs is not None:
                text_offset += sum(map(len, logprobs.tokens))
            choice = CompletionChoice(
                text=delta.text,
                logprobs=logprobs,
                finish_reason=delta.finish_reason,
                stop_reason=delta.stop_reason,
            )
            yield self._chunk(request_id, [choice])
        if request.include_usage and final is not None:
            yield self._chunk(request_id, [], usage=self.usage(final))

    def _chunk(self, request_id: str, choices: list[CompletionChoice], **kw) -> CompletionResponse:
        return CompletionResponse(
            id=request_id, model=self.served_model_name, choices=choices, **kw
        )

    def _logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]] | None, text_offset: int
    ) -> CompletionLogProbs | None:
        """OpenAI's legacy format. ``top_logprobs`` holds the requested top-k plus the sampled
        token when it is not among them (as vLLM does)."""
        if logprobs is None:
            return None
        result = CompletionLogProbs()
        for token_id, entry in zip(token_ids, logprobs):
            token = self.token_text(token_id)
            result.text_offset.append(text_offset)
            result.tokens.append(token)
            result.token_logprobs.append(entry[token_id])
            result.top_logprobs.append({self.token_text(t): lp for t, lp in entry.items()})
            text_offset += len(token)
        return result
