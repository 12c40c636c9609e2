"""POST /v1/chat/completions: messages rendered by the tokenizer's chat template."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi import Response

from pagedkv.engine.async_llm import RequestStream
from pagedkv.engine.chat_template import render_chat
from pagedkv.engine.outputs import PositionLogprobs, RequestOutput
from pagedkv.entrypoints.openai.errors import OpenAIError
from pagedkv.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChatResponseMessage,
    DeltaMessage,
    TopLogprob,
)
from pagedkv.entrypoints.openai.serving_engine import Delta, OpenAIServing

_UNSUPPORTED = ("logit_bias", "tools")


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: HTTPRequest
    ) -> Response:
        self.check_model(request)
        self.check_unsupported(request, _UNSUPPORTED)
        max_tokens, max_tokens_name = request.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, max_tokens_name = request.max_tokens, "max_tokens"
        param_names = self.param_names(
            max_tokens=max_tokens_name, logprobs="top_logprobs", prompt="messages"
        )
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, logprobs, param_names)
        request_id = self.request_id(raw_request, "chatcmpl")
        streams = self.submit(request_id, [self._render(request)], params, request, param_names)
        return await self.respond(request_id, streams, request, raw_request, param_names)

    def full_response(
        self, request_id: str, finals: list[RequestOutput], request: ChatCompletionRequest
    ) -> ChatCompletionResponse:
        (final,) = finals
        choices = [
            ChatCompletionChoice(
                index=completion.index,
                message=ChatResponseMessage(content=completion.text),
                logprobs=self._logprobs(completion.token_ids, completion.logprobs, request),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            for completion in final.outputs
        ]
        return ChatCompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=choices,
            usage=self.usage(finals),
            kv_transfer_params=self.kv_transfer_params(final, request),
        )

    def _render(self, request: ChatCompletionRequest) -> dict:
        messages = [message.as_template_dict() for message in request.messages]
        try:
            return render_chat(self.tokenizer, messages)
        except ValueError as e:
            raise OpenAIError(str(e), "messages") from None

    async def stream_chunks(
        self, request_id: str, streams: list[RequestStream], request: ChatCompletionRequest
    ) -> AsyncIterator[ChatCompletionStreamResponse]:
        deltas = self.deltas(streams, request.n)
        # The role chunks go out with the first token, not before: a request that fails
        # first (its KV could not be loaded) streams nothing but the error, which a proxy can
        # still retry elsewhere.
        first = await anext(deltas, None)
        for index in range(request.n):
            delta = DeltaMessage(role="assistant", content="")
            yield self._chunk(request_id, [ChatCompletionStreamChoice(index=index, delta=delta)])
        final, num_completion_tokens = None, 0
        async for delta in _prepend(first, deltas):
            final = delta.output
            num_completion_tokens += len(delta.token_ids)
            choice = ChatCompletionStreamChoice(
                index=delta.index,
                delta=DeltaMessage(content=delta.text),
                logprobs=self._logprobs(delta.token_ids, delta.logprobs, request),
                finish_reason=delta.finish_reason,
                stop_reason=delta.stop_reason,
            )
            yield self._chunk(request_id, [choice])
        if request.include_usage and final is not None:
            yield self._chunk(request_id, [], usage=self.usage([final], num_completion_tokens))

    def _chunk(
        self, request_id: str, choices: list[ChatCompletionStreamChoice], **kw
    ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=request_id, model=self.served_model_name, choices=choices, **kw
        )

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[PositionLogprobs] | None,
        request: ChatCompletionRequest,
    ) -> ChatChoiceLogprobs | None:
        """OpenAI's chat format: per token its logprob and exactly ``top_logprobs`` best."""
        if logprobs is None:
            return None
        k = request.top_logprobs or 0
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            best = sorted(entry.items(), key=lambda item: -item[1].logprob)[:k]
            content.append(
                ChatCompletionTokenLogprob(
                    **self._top_logprob(token_id, entry[token_id].logprob).model_dump(),
                    top_logprobs=[self._top_logprob(t, lp.logprob) for t, lp in best],
                )
            )
        return ChatChoiceLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_text(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))


async def _prepend(first: Delta | None, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    if first is not None:
        yield first
    async for delta in rest:
        yield delta
