"""OpenAIServing: what the completions and chat endpoints share.

Request ids, the model-name check, request fields -> SamplingParams, submitting to the engine
(ValueError -> 400 naming the field), answering (a full response, or SSE chunks ending with an
error event on failure and ``[DONE]``), usage, and turning a request's cumulative outputs into
deltas for streaming. An endpoint builds its own bodies: ``full_response`` and ``stream_chunks``.

A request the engine ended with an error (finish_reason ``error``: its KV could not be loaded
from another instance under ``kv_load_failure_policy=fail``) is never a 200 with empty text: it
is a 502 of type ``KVTransferError`` whose message names the peer and the cause, or, streamed,
an SSE error event of that type before ``[DONE]``. A request still running when a shutting-down
server gives up on it is a 503.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import NamedTuple

from fastapi import Request as HTTPRequest
from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from pagedkv.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    RequestAbortedError,
    RequestStream,
)
from pagedkv.engine.llm_engine import PromptType
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.entrypoints.openai.errors import KV_TRANSFER_ERROR, OpenAIError, bad_request_from
from pagedkv.entrypoints.openai.protocol import PromptTokensDetails, SamplingRequest, UsageInfo

#: SamplingParams fields that keep their name in requests (others are mapped per endpoint).
_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "prompt",
)


class Delta(NamedTuple):
    """What one streamed chunk adds to ``output`` (the cumulative output it came from)."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    output: RequestOutput

    @property
    def finish_reason(self) -> str | None:
        return self.output.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.output.outputs[0].stop_reason


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(error: OpenAIError) -> str:
    return sse(error.to_response())


class RequestFailedError(Exception):
    """The engine ended the request with an error (``RequestOutput.error``)."""


#: What the engine side may raise while a request is submitted or answered.
ENGINE_ERRORS = (ValueError, EngineDeadError, RequestAbortedError, RequestFailedError)


def engine_error(error: Exception, param_names: dict[str, str]) -> OpenAIError:
    if isinstance(error, EngineDeadError | RequestAbortedError):
        return OpenAIError(str(error), status=HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(error, RequestFailedError):
        return OpenAIError(str(error), status=HTTPStatus.BAD_GATEWAY, error_type=KV_TRANSFER_ERROR)
    assert isinstance(error, ValueError)
    return bad_request_from(error, param_names)


def check_failed(output: RequestOutput) -> RequestOutput:
    """``output``, unless the engine ended the request with an error: then that error."""
    if output.error is not None:
        raise RequestFailedError(output.error)
    return output


class OpenAIServing:
    def __init__(self, async_llm: AsyncLLM, served_model_name: str) -> None:
        self.async_llm = async_llm
        self.served_model_name = served_model_name
        self.tokenizer = async_llm.tokenizer

    @staticmethod
    def request_id(raw_request: HTTPRequest, prefix: str) -> str:
        """The response's id, ``{prefix}-{X-Request-Id header or a random id}``: a client (a
        proxy, a load generator) can choose the id and match responses to requests."""
        return f"{prefix}-{raw_request.headers.get('X-Request-Id') or uuid.uuid4().hex}"

    def check_model(self, request: SamplingRequest) -> None:
        if request.model is not None and request.model != self.served_model_name:
            raise OpenAIError(
                f"The model `{request.model}` does not exist "
                f"(this server serves `{self.served_model_name}`).",
                param="model",
            )

    @staticmethod
    def check_unsupported(request: BaseModel, names: tuple[str, ...]) -> None:
        for name in names:
            if name in request.model_fields_set and getattr(request, name) not in (None, False):
                raise OpenAIError(f"{name} is not supported by pagedkv", param=name)

    @staticmethod
    def param_names(**renamed: str) -> dict[str, str]:
        """Engine field name -> request field name, for naming the field in a 400."""
        return {name: name for name in _SAMPLING_FIELDS} | renamed

    @staticmethod
    def sampling_params(
        request: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        param_names: dict[str, str],
    ) -> SamplingParams:
        def given(value, default):
            return default if value is None else value

        try:
            return SamplingParams(
                n=request.n,
                temperature=given(request.temperature, 1.0),
                top_p=given(request.top_p, 1.0),
                top_k=given(request.top_k, 0),
                min_p=given(request.min_p, 0.0),
                seed=request.seed,
                stop=given(request.stop, []),
                stop_token_ids=given(request.stop_token_ids, []),
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                presence_penalty=given(request.presence_penalty, 0.0),
                frequency_penalty=given(request.frequency_penalty, 0.0),
                repetition_penalty=given(request.repetition_penalty, 1.0),
                include_stop_str_in_output=request.include_stop_str_in_output,
                skip_special_tokens=request.skip_special_tokens,
            )
        except ValueError as e:
            raise bad_request_from(e, param_names) from None

    def submit(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        request: SamplingRequest,
        param_names: dict[str, str],
    ) -> RequestStream:
        """Submit under an engine id of its own, ``{request_id}-{random suffix}``: clients may
        send the same X-Request-Id twice, and each request must still be its own in the engine
        (never refused, nor aborted by the other's disconnection)."""
        try:
            return self.async_llm.add_request(
                f"{request_id}-{uuid.uuid4().hex[:8]}",
                prompt,
                params,
                priority=request.priority,
                cache_salt=request.cache_salt,
                kv_transfer_params=request.kv_transfer_params,
            )
        except (ValueError, EngineDeadError) as e:
            raise engine_error(e, param_names) from None

    async def respond(
        self,
        request_id: str,
        stream: RequestStream,
        request: SamplingRequest,
        raw_request: HTTPRequest,
        param_names: dict[str, str],
    ) -> Response:
        """Stream the answer as SSE, or wait for all of it (499 if the client goes first)."""
        if request.stream:
            chunks = self.stream_chunks(request_id, stream, request)
            return StreamingResponse(self._sse(chunks, param_names), media_type="text/event-stream")
        try:
            final = await self.final_output(stream, raw_request)
            if final is None:  # the client is gone
                return Response(status_code=499)
            check_failed(final)
        except ENGINE_ERRORS as e:
            raise engine_error(e, param_names) from None
        return JSONResponse(self.full_response(request_id, final, request).model_dump())

    def full_response(
        self, request_id: str, final: RequestOutput, request: SamplingRequest
    ) -> BaseModel:
        """The endpoint's non-streaming body."""
        raise NotImplementedError

    def stream_chunks(
        self, request_id: str, stream: RequestStream, request: SamplingRequest
    ) -> AsyncIterator[BaseModel]:
        """The endpoint's streamed chunks, the usage chunk included."""
        raise NotImplementedError

    @staticmethod
    async def _sse(
        chunks: AsyncIterator[BaseModel], param_names: dict[str, str]
    ) -> AsyncIterator[str]:
        """Each chunk as an SSE event; a failed request ends with an error event; then [DONE]."""
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except ENGINE_ERRORS as e:
            yield sse_error(engine_error(e, param_names))
        yield SSE_DONE

    @staticmethod
    async def final_output(stream: RequestStream, raw_request: HTTPRequest) -> RequestOutput | None:
        """The request's last output, or None if the client disconnected first (the request
        is aborted then: leaving the stream's iteration aborts it)."""

        async def last() -> RequestOutput:
            final = None
            async for output in stream:
                final = output
            return final

        async def disconnected() -> None:
            while (await raw_request.receive())["type"] != "http.disconnect":
                pass

        generation = asyncio.ensure_future(last())
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({generation, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not generation.done():
                generation.cancel()
        if generation.cancelled():
            return None
        return generation.result()

    @staticmethod
    async def deltas(stream: RequestStream) -> AsyncIterator[Delta]:
        """Turn cumulative outputs into what each chunk adds (RequestFailedError for a request
        the engine ended with an error). Text may lag behind tokens (held
        back while it could still become a stop string, or until its bytes form a character):
        a chunk then carries new tokens with empty text, as in vLLM, so a client sees each
        step (and measures time to first token) when it happens. An output that adds nothing
        is skipped (never the last one, which has a finish reason)."""
        num_chars = num_tokens = 0
        async for output in stream:
            completion = check_failed(output).outputs[0]
            logprobs = completion.logprobs
            delta = Delta(
                text=completion.text[num_chars:],
                token_ids=completion.token_ids[num_tokens:],
                logprobs=logprobs[num_tokens:] if logprobs is not None else None,
                output=output,
            )
            num_chars, num_tokens = len(completion.text), len(completion.token_ids)
            if delta.text or delta.token_ids or delta.finish_reason is not None:
                yield delta

    @staticmethod
    def usage(output: RequestOutput) -> UsageInfo:
        num_prompt_tokens = len(output.prompt_token_ids)
        num_completion_tokens = len(output.outputs[0].token_ids)
        return UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens),
        )

    @staticmethod
    def kv_transfer_params(output: RequestOutput, request: SamplingRequest) -> dict | None:
        """The engine's (a KV connector's) params; without a connector the engine returns none
        and the request's own are echoed, so a proxy can round-trip its state."""
        if output.kv_transfer_params is not None:
            return output.kv_transfer_params
        return request.kv_transfer_params

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)
