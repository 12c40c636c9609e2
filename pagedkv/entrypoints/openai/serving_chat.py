"""POST /v1/chat/completions: messages rendered by the tokenizer's chat template."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse

from pagedkv.engine.async_llm import EngineDeadError, RequestStream
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
from pagedkv.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    engine_error,
    sse,
    sse_error,
)

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
        stream = self.submit(request_id, self._render(request), params, request, param_names)
        if request.stream:
            return StreamingResponse(
                self._stream(request_id, stream, request, param_names),
                media_type="text/event-stream",
            )
        try:
            final = await self.final_output(stream, raw_request)
        except (ValueError, EngineDeadError) as e:
            raise engine_error(e, param_names) from None
        if final is None:  # the client is gone
            return Response(status_code=499)
        completion = final.outputs[0]
        choice = ChatCompletionChoice(
            message=ChatResponseMessage(content=completion.text),
            logprobs=self._logprobs(completion.token_ids, completion.logprobs, request),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        response = ChatCompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=[choice],
            usage=self.usage(final),
            kv_transfer_params=self.kv_transfer_params(final, request),
        )
        return JSONResponse(response.model_dump())

    def _render(self, request: ChatCompletionRequest) -> dict:
        """The prompt as text (for the output) and token ids. The template already holds any
        special tokens (BOS), so the text is tokenized without adding them again."""
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer, so no chat template", "messages")
        messages = [message.as_template_dict() for message in request.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # no template, or one that rejects these messages (jinja)
            raise OpenAIError(f"cannot apply the chat template: {e}", "messages") from None
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": token_ids}

    async def _stream(
        self,
        request_id: str,
        stream: RequestStream,
        request: ChatCompletionRequest,
        param_names: dict[str, str],
    ) -> AsyncIterator[str]:
        role = ChatCompletionStreamChoice(delta=DeltaMessage(role="assistant", content=""))
        yield sse(self._chunk(request_id, [role]))
        final = None
        try:
            async for delta in self.deltas(stream):
                final = delta.output
                if not delta.text and delta.finish_reason is None and delta.logprobs is None:
                    continue  # text held back (a possible stop string) and nothing else to say
                choice = ChatCompletionStreamChoice(
                    delta=DeltaMessage(content=delta.text),
                    logprobs=self._logprobs(delta.token_ids, delta.logprobs, request),
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
                yield sse(self._chunk(request_id, [choice]))
        except (ValueError, EngineDeadError) as e:
            yield sse_error(engine_error(e, param_names))
        else:
            if request.include_usage and final is not None:
                yield sse(self._chunk(request_id, [], usage=self.usage(final)))
        yield SSE_DONE

    def _chunk(
        self, request_id: str, choices: list[ChatCompletionStreamChoice], **kw
    ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=request_id, model=self.served_model_name, choices=choices, **kw
        )

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[dict[int, float]] | None,
        request: ChatCompletionRequest,
    ) -> ChatChoiceLogprobs | None:
        """OpenAI's chat format: per token its logprob and exactly ``top_logprobs`` best."""
        if logprobs is None:
            return None
        k = request.top_logprobs or 0
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            best = sorted(entry.items(), key=lambda item: -item[1])[:k]
            content.append(
                ChatCompletionTokenLogprob(
                    **self._top_logprob(token_id, entry[token_id]).model_dump(),
                    top_logprobs=[self._top_logprob(t, lp) for t, lp in best],
                )
            )
        return ChatChoiceLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_text(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))
