"""What the worker returns after a step: one result type for prefill and decode alike."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.kv_connector.output import KVConnectorOutput


@dataclass(slots=True)
class Logprobs:
    """Log-probabilities at one position: the chosen token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    #: 1-based rank of the chosen token among all vocabulary entries.
    rank: int


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    #: Per request (``req_ids`` order): the sampled token, or nothing for a prefill chunk that
    #: did not reach the end of the prompt.
    sampled_token_ids: list[list[int]]
    #: Per request: logprobs of the sampled position when the request asked for them.
    logprobs: list[Logprobs | None] | None = None
    #: Prompt logprobs of the positions computed this step (prompt token ``i+1`` given ``≤ i``).
    prompt_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    #: Requests whose batch row ran this step (for stats such as the batch size).
    num_reqs: int = 0
    kv_connector_output: KVConnectorOutput | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
