"""What the worker returns after a step: one result type for prefill and decode alike."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprobs:
    """Log-probabilities at one position: the chosen token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    #: 1-based rank of the chosen token among all vocabulary entries.
    rank: int


@dataclass
class KVConnectorOutput:
    """What a KV connector's worker half reports after a step."""

    #: Producer: transfers whose held blocks may now be freed (delivered, refused, failed or
    #: lease expired).
    finished_sending: set[str] = field(default_factory=set)
    #: Consumer: loads that ended (successfully or not); no byte lands in their blocks after.
    finished_recving: set[str] = field(default_factory=set)
    #: Blocks whose load failed (reported with or before the request's finished_recving).
    invalid_block_ids: set[int] = field(default_factory=set)
    #: Consumer: why a load failed, by request id (the peer and the cause), for the error a
    #: client sees under kv_load_failure_policy=fail.
    load_errors: dict[str, str] = field(default_factory=dict)
    #: Consumer: loads whose source still computes their KV (their request is queued or in
    #: prefill there): their deadline counts from now.
    loads_in_progress: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.finished_recving
            or self.invalid_block_ids
            or self.loads_in_progress
        )


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
