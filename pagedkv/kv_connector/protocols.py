"""What the connector contract reads from the floors above it, as Protocols.

The engine's ``Request``, the scheduler's ``SchedulerOutput`` and attention's
``AttentionMetadata`` satisfy these structurally; this floor imports none of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class FinishState(Protocol):
    @property
    def finish_reason(self) -> str | None: ...


class PromptLogprobsRequest(Protocol):
    prompt_logprobs: int | None


class ConnectorRequest(Protocol):
    """The request fields a scheduler-side connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    #: Chained hashes of the request's full blocks, grown as tokens arrive.
    block_hashes: list[bytes]
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int
    status: FinishState
    sampling_params: PromptLogprobsRequest

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> list[int]: ...


class ScheduledRequest(Protocol):
    req_id: str
    num_computed_tokens: int


class ScheduledStep(Protocol):
    """One step of the scheduler's output, as far as a connector plans from it."""

    scheduled_new_reqs: Sequence[ScheduledRequest]
    scheduled_cached_reqs: Sequence[ScheduledRequest]
    #: Tokens computed this step per request id.
    num_scheduled_tokens: Mapping[str, int]


class LayerAttentionMetadata(Protocol):
    """What ``save_kv_layer`` may read of a layer's step: where this step's tokens landed."""

    slot_mapping: torch.Tensor
