"""POST /v1/completions: text or token-id prompts (one or a batch), ``n`` choices each,
streamed (SSE) or not.

``echo`` (vLLM's): each choice's text, tokens and logprobs start with its prompt's (a token-id
prompt's text is its decoding). With ``logprobs=k`` the engine is asked for the prompt's logprobs
too (``prompt_logprobs=k``, which also keeps the prompt off the prefix cache, so every position is
computed); the first prompt token has none (null). ``max_tokens=0`` with echo answers the prompt
alone: the engine samples one token, which is dropped and not counted. Streamed, each choice's
first chunk carries its prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi import Response

from pagedkv.engine.async_llm import RequestStream
from pagedkv.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedkv.entrypoints.openai.errors import OpenAIError
from pagedkv.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
)
from pagedkv.entrypoints.openai.serving_engine import Delta, OpenAIServing

#: OpenAI's default for the legacy completions endpoint.
DEFAULT_MAX_TOKENS = 16
_UNSUPPORTED = ("suffix", "logit_bias")

#: A choice's text, token ids and (when asked for) per-token logprobs.
Content = tuple[str, list[int], list[PositionLogprobs | None] | None]


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
        if request.echo and self.tokenizer is None:
            raise OpenAIError("echo needs the model's tokenizer", "echo")
        param_names = self.param_names()
        max_tokens = request.max_tokens
        if _echo_only(request):
            max_tokens = 1  # vLLM's echo without generation: the one token is dropped
        params = self.sampling_params(
            request, max_tokens, request.logprobs, param_names, DEFAULT_MAX_TOKENS
        )
        if request.echo and request.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=request.logprobs)
        request_id = self.request_id(raw_request, "cmpl")
        streams = self.submit(request_id, request.prompts, params, request, param_names)
        return await self.respond(request_id, streams, request, raw_request, param_names)

    def full_response(
        self, request_id: str, finals: list[RequestOutput], request: CompletionRequest
    ) -> CompletionResponse:
        choices = []
        for i, final in enumerate(finals):
            for completion in final.outputs:
                text, token_ids, logprobs = self._content(
                    request, completion, final, final.prompt_logprobs, request.echo
                )
                choices.append(
                    CompletionChoice(
                        index=i * request.n + completion.index,
                        text=text,
                        logprobs=self._logprobs(token_ids, logprobs, 0),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                )
        return CompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=choices,
            usage=self.usage(finals, 0 if _echo_only(request) else None),
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
            first = delta.index not in text_offsets
            text, token_ids, logprobs = self._content(
                request, delta, delta.output, delta.prompt_logprobs, request.echo and first
            )
            if not _echo_only(request):
                num_completion_tokens += len(delta.token_ids)
            text_offset = text_offsets.get(delta.index, 0)
            logprobs = self._logprobs(token_ids, logprobs, text_offset)
            text_offsets[delta.index] = text_offset + (
                sum(map(len, logprobs.tokens)) if logprobs is not None else 0
            )
            choice = CompletionChoice(
                index=delta.index,
                text=text,
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

    def _content(
        self,
        request: CompletionRequest,
        generated: CompletionOutput | Delta,
        output: RequestOutput,
        prompt_logprobs: list[PositionLogprobs | None] | None,
        with_prompt: bool,
    ) -> Content:
        """What a choice (or its chunk) carries: ``generated``, after the prompt's text, tokens
        and logprobs when ``with_prompt``; nothing generated under echo with ``max_tokens=0``."""
        text, token_ids, logprobs = generated.text, generated.token_ids, generated.logprobs
        if _echo_only(request):
            text, token_ids = "", []
            logprobs = [] if logprobs is not None else None
        if not with_prompt:
            return text, token_ids, logprobs
        prompt_text = output.prompt
        if prompt_text is None:  # a token-id prompt
            prompt_text = self.tokenizer.decode(output.prompt_token_ids)
        if logprobs is not None:
            logprobs = [*(prompt_logprobs or ()), *logprobs]
        return prompt_text + text, [*output.prompt_token_ids, *token_ids], logprobs

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[PositionLogprobs | None] | None,
        text_offset: int,
    ) -> CompletionLogProbs | None:
        """OpenAI's legacy format. ``top_logprobs`` holds the requested top-k plus the sampled
        token when it is not among them (as vLLM does); a position without logprobs (an echoed
        prompt's first token) has null in both lists, as in vLLM."""
        if logprobs is None:
            return None
        result = CompletionLogProbs()
        for token_id, entry in zip(token_ids, logprobs, strict=True):
            token = self.token_text(token_id)
            result.text_offset.append(text_offset)
            result.tokens.append(token)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                result.token_logprobs.append(entry[token_id].logprob)
                top = {self.token_text(t): lp.logprob for t, lp in entry.items()}
                result.top_logprobs.append(top)
            text_offset += len(token)
        return result


def _echo_only(request: CompletionRequest) -> bool:
    """vLLM's echo without generation: the prompt is the whole answer."""
    return request.echo and request.max_tokens == 0
