"""RequestInput: what a caller submits to ``LLMEngine`` or ``AsyncLLM``, built once at the edge
(``LLM.generate``, the OpenAI server, the CLI) and passed through unchanged."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from pagedkv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedkv.engine.request import Request

#: Text, token ids, or ``{"prompt": text}`` / ``{"prompt_token_ids": ids, "prompt": text}``.
PromptType = str | Sequence[int] | dict


@dataclass(frozen=True, slots=True)
class RequestInput:
    """One request before tokenization. ``params`` None: the model's generation config
    (``LLMEngine.default_sampling_params``); ``request_id`` None: the engine names it."""

    prompt: PromptType
    params: SamplingParams | None = None
    request_id: str | None = None
    _: KW_ONLY
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    #: Mixed into the block hashes: only requests with the same salt share prefix-cache hits.
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None
    #: Refuse a ``max_tokens`` that the context cannot hold instead of capping it (the server).
    max_tokens_must_fit: bool = False

    def __post_init__(self) -> None:
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        if self.params is not None and self.params.n > 1 and self.kv_transfer_params is not None:
            raise ValueError("n > 1 cannot be combined with kv_transfer_params")


class NewRequest(NamedTuple):
    """A validated request, not yet in the engine: its ``n`` children (one when n == 1, under
    ``request_id`` itself)."""

    request_id: str
    prompt_text: str | None
    children: list[Request]
