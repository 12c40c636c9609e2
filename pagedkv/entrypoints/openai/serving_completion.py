"""POST /v1/completions: text or token-id prompts (one or a batch), ``n`` choices each,
streamed (SSE) or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi import Response

from pagedkv.engine.async_llm import RequestStream
from pagedkv.engine.outputs import PositionLogprobs, RequestOutput
from pagedkv.entrypoints.openai.errors import OpenAIError
from pagedkv.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
)
from pagedkv.entrypoints.openai.serving_engine import OpenAIServing

#: OpenAI's default for the legacy completions endpoint.
DEFAULT_MAX_TOKENS = 16
_UNSUPPORTED = ("echo", "suffix", "logit_bias")


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest, raw_request: HTTPRequest
    ) -> Response:
        self.check_model(request)
        self.check_unsupported(request, _UNSUPPORTED)
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError(
                "best_of is not supported unless equal to n (vLLM V1 dropped it)", "best_of"
            )
        param_names = self.param_names()
        params = self.sampling_params(
            request, request.max_tokens, request.logprobs, param_names, DEFAULT_MAX_TOKENS
        )
        request_id = self.request_id(raw_request, "cmpl")
        streams = self.submit(request_id, request.prompts, params, request, param_names)
        return await self.respond(request_id, streams, request, raw_request, param_names)

    def full_response(
        self, request_id: str, finals: list[RequestOutput], request: CompletionRequest
    ) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=i * request.n + completion.index,
                text=completion.text,
                logprobs=self._logprobs(completion.token_ids, completion.logprobs, 0),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            for i, final in enumerate(finals)
            for completion in final.outputs
        ]
        return CompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=choices,
            usage=self.usage(finals),
            kv_transfer_params=self.kv_transfer_params(finals[0], request),
        )

    async def stream_chunks(
        self, request_id: str, streams: list[RequestStream], request: CompletionRequest
    ) -> AsyncIterator[CompletionResponse]:
        text_offsets: dict[int, int] = {}
        finals: dict[str, RequestOutput] = {}  # the latest output of each prompt
        num_completion_tokens = 0
        async for delta in self.deltas(streams, request.n):
            finals[delta.output.request_id] = delta.output
            num_completion_tokens += len(delta.token_ids)
            text_offset = text_offsets.get(delta.index, 0)
            logprobs = self._logprobs(delta.token_ids, delta.logprobs, text_offset)
            if logprobs is not None:
                text_offsets[delta.index] = text_offset + sum(map(len, logprobs.tokens))
            choice = CompletionChoice(
                index=delta.index,
                text=delta.text,
                logprobs=logprobs,
                finish_reason=delta.finish_reason,
                stop_reason=delta.stop_reason,
            )
            yield self._chunk(request_id, [choice])
        if request.include_usage and finals:
            usage = self.usage(list(finals.values()), num_completion_tokens)
            yield self._chunk(request_id, [], usage=usage)

    def _chunk(self, request_id: str, choices: list[CompletionChoice], **kw) -> CompletionResponse:
        return CompletionResponse(
            id=request_id, model=self.served_model_name, choices=choices, **kw
        )

    def _logprobs(
        self, token_ids: list[int], logprobs: list[PositionLogprobs] | None, text_offset: int
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
            result.token_logprobs.append(entry[token_id].logprob)
            result.top_logprobs.append({self.token_text(t): lp.logprob for t, lp in entry.items()})
            text_offset += len(token)
        return result
