"""OpenAIServing: what the completions and chat endpoints share.

Request ids, the model-name check, request fields -> SamplingParams (the model's generation
config filling what a request leaves out), structured outputs, submitting to the engine
(ValueError -> 400 naming the field), answering (a full response, or SSE chunks ending with an
error event on failure and ``[DONE]``), usage, and turning a request's cumulative outputs into
deltas for streaming. A request may hold several prompts (a batch): each is its own engine
request with ``n`` sequences, choice ``i * n + j`` being prompt ``i``'s sequence ``j``. An
endpoint builds its own bodies: ``full_response`` and ``stream_chunks``.

A request the engine ended with an error (finish_reason ``error``: its KV could not be loaded
from another instance under ``kv_load_failure_policy=fail``) is never a 200 with empty text: it
is a 502 of type ``KVTransferError`` whose message names the peer and the cause, or, streamed,
an SSE error event of that type before ``[DONE]``. A request still running when a shutting-down
server gives up on it is a 503.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
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
from pagedkv.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedkv.engine.request_input import PromptType, RequestInput
from pagedkv.entrypoints.openai.errors import (
    KV_TRANSFER_ERROR,
    OpenAIError,
    bad_request_from,
    model_not_found,
)
from pagedkv.entrypoints.openai.protocol import PromptTokensDetails, SamplingRequest, UsageInfo
from pagedkv.entrypoints.openai.stream_merge import final_outputs, merge_streams
from pagedkv.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

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


#: Request fields that ask for structured outputs (vLLM's extras besides OpenAI's one).
_STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class Delta(NamedTuple):
    """What one streamed chunk adds to choice ``index`` (``completion`` and ``output``: the
    engine's delta it came from; ``prompt_logprobs``: those of the choice's prompt received so
    far, when asked for)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    completion: CompletionOutput
    output: RequestOutput
    prompt_logprobs: list[PositionLogprobs | None] | None

    @property
    def finish_reason(self) -> str | None:
        return self.completion.finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.completion.stop_reason


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
        #: The model's generation config: defaults for the fields a request leaves out.
        self.default_sampling = async_llm.llm_engine.model_runner.generation_defaults.sampling

    @staticmethod
    def request_id(raw_request: HTTPRequest, prefix: str) -> str:
        """The response's id, ``{prefix}-{X-Request-Id header or a random id}``: a client (a
        proxy, a load generator) can choose the id and match responses to requests."""
        return f"{prefix}-{raw_request.headers.get('X-Request-Id') or uuid.uuid4().hex}"

    def check_model(self, request: BaseModel) -> None:
        model = getattr(request, "model", None)
        if model is not None and model != self.served_model_name:
            raise model_not_found(model, self.served_model_name)

    @staticmethod
    def check_unsupported(request: BaseModel, names: tuple[str, ...]) -> None:
        for name in names:
            if name in request.model_fields_set and getattr(request, name) not in (None, False):
                raise OpenAIError(f"{name} is not supported by pagedkv", param=name)

    @staticmethod
    def param_names(**renamed: str) -> dict[str, str]:
        """Engine field name -> request field name, for naming the field in a 400."""
        return {name: name for name in _SAMPLING_FIELDS} | renamed

    def sampling_params(
        self,
        request: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        param_names: dict[str, str],
        endpoint_max_tokens: int | None = None,
    ) -> SamplingParams:
        """The request's fields; those it leaves out come from the model's generation config
        (``--generation-config``), then from vLLM's defaults (``max_tokens``: the config's
        ``max_new_tokens``, else ``endpoint_max_tokens``, else up to the context length)."""
        defaults = SamplingParams(**self.default_sampling)
        if max_tokens is None:
            max_tokens = self.default_sampling.get("max_tokens", endpoint_max_tokens)

        def given(name: str, value=None):
            value = getattr(request, name) if value is None else value
            return getattr(defaults, name) if value is None else value

        try:
            return SamplingParams(
                n=request.n,
                temperature=given("temperature"),
                top_p=given("top_p"),
                top_k=given("top_k"),
                min_p=given("min_p"),
                seed=request.seed,
                stop=given("stop"),
                stop_token_ids=given("stop_token_ids"),
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                presence_penalty=given("presence_penalty"),
                frequency_penalty=given("frequency_penalty"),
                repetition_penalty=given("repetition_penalty"),
                include_stop_str_in_output=request.include_stop_str_in_output,
                skip_special_tokens=request.skip_special_tokens,
                structured_outputs=self.structured_outputs(request),
                # vLLM's: a stream is made of what each step adds, a whole answer of the last
                # output alone (no per-step copies of everything generated so far).
                output_kind=(
                    RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
                ),
            )
        except ValueError as e:
            raise bad_request_from(e, param_names) from None

    @staticmethod
    def structured_fields(request: SamplingRequest) -> list[str]:
        """The request fields that ask for structured outputs."""
        return [
            name
            for name in _STRUCTURED_FIELDS
            if getattr(request, name) is not None
            and not (name == "response_format" and request.response_format.type == "text")
        ]

    def structured_outputs(self, request: SamplingRequest) -> StructuredOutputsParams | None:
        """From ``response_format`` (OpenAI), ``structured_outputs`` or ``guided_*`` (vLLM); at
        most one of them. Raises OpenAIError naming the field."""
        given = self.structured_fields(request)
        if not given:
            return None
        if len(given) > 1:
            raise OpenAIError(f"give at most one of {', '.join(given)}", param=given[1])
        field = given[0]
        try:
            if field == "response_format":
                response_format = request.response_format
                if response_format.type == "json_object":
                    return StructuredOutputsParams(json_object=True)
                return StructuredOutputsParams(json=response_format.json_schema.schema_)
            if field == "structured_outputs":
                options = request.structured_outputs.model_dump(by_alias=True)
                return StructuredOutputsParams(**options)
            kind = field.removeprefix("guided_")
            return StructuredOutputsParams(**{kind: getattr(request, field)})
        except ValueError as e:
            raise OpenAIError(str(e), param=field) from None

    def submit(
        self,
        request_id: str,
        prompts: Sequence[PromptType],
        params: SamplingParams,
        request: SamplingRequest,
        param_names: dict[str, str],
    ) -> list[RequestStream]:
        """Submit each prompt under an engine id of its own, ``{request_id}-{random suffix}``:
        clients may send the same X-Request-Id twice, and each request must still be its own
        in the engine (never refused, nor aborted by the other's disconnection). A refused
        prompt aborts those of the batch already submitted."""
        streams: list[RequestStream] = []
        try:
            for prompt in prompts:
                engine_request = RequestInput(
                    prompt,
                    params,
                    f"{request_id}-{uuid.uuid4().hex[:8]}",
                    priority=request.priority,
                    cache_salt=request.cache_salt,
                    kv_transfer_params=request.kv_transfer_params,
                    max_tokens_must_fit=True,
                )
                streams.append(self.async_llm.add_request(engine_request))
        except (ValueError, EngineDeadError) as e:
            for stream in streams:
                self.async_llm.abort(stream.request_id, stream)
            # A grammar the engine cannot compile: name the field it came from.
            for field in self.structured_fields(request)[:1]:
                param_names = param_names | {"structured_outputs": field}
            raise engine_error(e, param_names) from None
        return streams

    async def respond(
        self,
        request_id: str,
        streams: list[RequestStream],
        request: SamplingRequest,
        raw_request: HTTPRequest,
        param_names: dict[str, str],
    ) -> Response:
        """Stream the answer as SSE, or wait for all of it (499 if the client goes first)."""
        if request.stream:
            chunks = self.stream_chunks(request_id, streams, request)
            return StreamingResponse(self._sse(chunks, param_names), media_type="text/event-stream")
        try:
            finals = await final_outputs(streams, raw_request)
            if finals is None:  # the client is gone
                return Response(status_code=499)
            for final in finals:
                check_failed(final)
        except ENGINE_ERRORS as e:
            raise engine_error(e, param_names) from None
        return JSONResponse(self.full_response(request_id, finals, request).model_dump())

    def full_response(
        self, request_id: str, finals: list[RequestOutput], request: SamplingRequest
    ) -> BaseModel:
        """The endpoint's non-streaming body (``finals``: one output per prompt)."""
        raise NotImplementedError

    def stream_chunks(
        self, request_id: str, streams: list[RequestStream], request: SamplingRequest
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
    async def deltas(streams: list[RequestStream], n: int = 1) -> AsyncIterator[Delta]:
        """What each chunk adds, per choice (prompt ``i``'s sequence ``j`` is choice
        ``i * n + j``), from the engine's ``DELTA`` outputs: each holds the sequences that moved,
        with only what is new. Text may lag behind tokens (held back while it could still become
        a stop string, or until its bytes form a character): a chunk then carries new tokens
        with empty text, as in vLLM, so a client sees each step (and measures time to first
        token) when it happens. A request the engine ended with an error raises
        RequestFailedError."""
        prompt_logprobs: dict[int, list[PositionLogprobs | None]] = {}
        async for prompt_index, output in merge_streams(streams):
            if output.prompt_logprobs is not None:  # may come over several prefill chunks
                prompt_logprobs.setdefault(prompt_index, []).extend(output.prompt_logprobs)
            for completion in check_failed(output).outputs:
                yield Delta(
                    index=prompt_index * n + completion.index,
                    text=completion.text,
                    token_ids=completion.token_ids,
                    logprobs=completion.logprobs,
                    completion=completion,
                    output=output,
                    prompt_logprobs=prompt_logprobs.get(prompt_index),
                )

    @staticmethod
    def usage(
        outputs: Sequence[RequestOutput], num_completion_tokens: int | None = None
    ) -> UsageInfo:
        """Prompt tokens once per prompt (``outputs``: one per prompt), completion tokens over
        every choice (OpenAI's): those of ``outputs``, or ``num_completion_tokens`` when the
        outputs were deltas."""
        num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        if num_completion_tokens is None:
            num_completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(o.num_cached_tokens for o in outputs)
            ),
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
