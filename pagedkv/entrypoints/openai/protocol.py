"""OpenAI API request and response bodies (pydantic), with vLLM's extensions.

Requests ignore unknown fields, as OpenAI does, naming them in a WARNING (``OpenAIBaseModel``).
Values are checked for type here and for range by SamplingParams, whose ValueErrors become 400
responses naming the field.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from pagedkv.entrypoints.openai.request_base import OpenAIBaseModel

# ---------------------------------------------------------------------------- requests


def _json_compliant(value: Any) -> bool:
    """No NaN or infinite float anywhere in ``value`` (parsed JSON: bounded depth)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_json_compliant(v) for v in value.values())
    if isinstance(value, list):
        return all(_json_compliant(v) for v in value)
    return True


def _has_lone_surrogate(value: Any) -> bool:
    """A UTF-16 surrogate with no pair (JSON ``"\\ud800"``): no tokenizer or UTF-8 encoder can
    take it."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, BaseModel):
        return any(_has_lone_surrogate(v) for v in value.__dict__.values())
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_lone_surrogate(v) for v in value)
    return False


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    #: OpenAI's field name; ``json_schema`` is accepted too (vLLM does).
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = {"populate_by_name": True}


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.schema_ is None
        ):
            raise ValueError("type json_schema needs json_schema.schema")
        return self


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` request field (the fields of StructuredOutputsParams)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    model_config = {"populate_by_name": True}


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. ``None`` = the default."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("*", mode="after")
    @classmethod
    def _no_lone_surrogates(cls, value):
        if _has_lone_surrogate(value):
            raise ValueError("must not contain lone UTF-16 surrogates (such as \\ud800)")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, options, info):
        if options is not None and not info.data.get("stream"):
            raise ValueError("can only be given when stream is true")
        return options

    @field_validator("kv_transfer_params")
    @classmethod
    def _json_compliant(cls, params):
        """The response may echo these back: a value JSON cannot carry (NaN, Infinity, which
        Python's parser lets in) is refused here, not met as a 500 once the request ran."""
        if params is not None and not _json_compliant(params):
            raise ValueError("must not contain NaN or Infinity")
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    #: Text, or token ids; or a batch: a list of texts or of token-id lists (one choice each,
    #: times ``n``).
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompts(cls, prompt):
        if len(prompt) == 0 or (
            isinstance(prompt, list)
            and any(len(p) == 0 for p in prompt if isinstance(p, str | list))
        ):
            raise ValueError("must not be empty, nor hold an empty prompt")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt per choice group."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[dict[str, Any]] | None = None


# ---------------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token (an echoed prompt's
    first, whose logprob and top_logprobs are null: it has no context)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    #: vLLM extension: the stop string or stop token id that ended the request.
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatCompletionTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if _has_lone_surrogate(self.prompt) or _has_lone_surrogate(self.messages):
            raise ValueError("must not contain lone UTF-16 surrogates (such as \\ud800)")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedkv"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    #: The HTTP status, or OpenAI's code string where it has one (``model_not_found``).
    code: int | str


class ErrorResponse(BaseModel):
    error: ErrorInfo
