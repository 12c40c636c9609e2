"""The warm-up's steps: what the model runner runs once at start so that the first request costs
what the second does (vLLM's profile run). Every lazy first-call cost (OpenMP thread pools,
oneDNN and MKL primitives, torch's sampling ops, Triton compiles on GPU) is paid here.

Two dummy requests go straight to the runner, never through the scheduler, so the KV cache
manager, the prefix cache, its statistics and KV events never see them:

    greedy  plain (one argmax, nothing else)
    sampled seeded sampling with every option: temperature, top-k, top-p, min-p, the three
            penalties, min_tokens, logprobs and prompt logprobs

    step 1  prefill both              prefill kernels, batched products, prompt logprobs,
                                      the full sampler beside a greedy row
    step 2  decode both               batched decode (the modules), the LM head's batch layout
    step 3  sampled leaves;           the one-request decode layer, the LM head's one-row
            decode greedy alone       layout, the greedy argmax alone
    step 4  greedy leaves             the batch is empty again

With ``max_num_seqs`` 1 (no batch ever holds two) each request runs alone instead: prefill,
decode, leave. Both are seeded, so the global generator draws nothing. Every block-table entry
is the null block (block 0): their KV lands there, garbage (both write the same slots), and
the runner zeroes the null block afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.sampling_params import SamplingParams
from pagedkv.utils import cdiv
from pagedkv.worker.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

#: Tokens of each dummy prompt (fewer where the context is shorter).
PROMPT_LEN = 8
_GREEDY = SamplingParams(temperature=0.0, max_tokens=2, seed=0)
_SAMPLED = SamplingParams(
    temperature=0.8,
    top_k=5,
    top_p=0.9,
    min_p=0.01,
    repetition_penalty=1.1,
    presence_penalty=0.1,
    frequency_penalty=0.1,
    min_tokens=2,
    max_tokens=2,
    seed=0,
    logprobs=2,
    prompt_logprobs=2,
)


@dataclass(slots=True)
class _Dummy:
    req_id: str
    params: SamplingParams
    num_computed_tokens: int = 0


class _Steps:
    """Builds each step's ``SchedulerOutput`` as the scheduler would, for dummies that hold
    only the null block."""

    def __init__(self, prompt: list[int], block_ids: tuple[list[int], ...]) -> None:
        self.prompt = prompt
        self.block_ids = block_ids

    def step(
        self, prefill: tuple[_Dummy, ...] = (), decode: tuple[_Dummy, ...] = (), leave=()
    ) -> SchedulerOutput:
        n = len(self.prompt)
        new = [
            NewRequestData(d.req_id, self.prompt, n, d.params, self.block_ids, 0) for d in prefill
        ]
        no_blocks = tuple([] for _ in self.block_ids)
        cached = [CachedRequestData(d.req_id, no_blocks, d.num_computed_tokens) for d in decode]
        counts = {d.req_id: 1 for d in decode} | {d.req_id: n for d in prefill}
        for d in (*decode, *prefill):
            d.num_computed_tokens += counts[d.req_id]
        return SchedulerOutput(
            new, cached, counts, sum(counts.values()), finished_req_ids={d.req_id for d in leave}
        )


def warm_up_steps(
    vocab_size: int, max_model_len: int, block_sizes: list[int], max_num_reqs: int
) -> list[SchedulerOutput]:
    """The steps above, for a context of ``max_model_len`` tokens (none under 3: a prompt and
    two decodes must fit)."""
    prompt_len = min(PROMPT_LEN, max_model_len - 2)
    if prompt_len < 1:
        return []
    prompt = [i % vocab_size for i in range(1, prompt_len + 1)]
    steps = _Steps(prompt, tuple([0] * cdiv(prompt_len + 2, size) for size in block_sizes))
    greedy, sampled = _Dummy("warm-up-greedy", _GREEDY), _Dummy("warm-up-sampled", _SAMPLED)
    if max_num_reqs == 1:
        return [
            steps.step(prefill=(sampled,)),
            steps.step(decode=(sampled,)),
            steps.step(prefill=(greedy,), leave=(sampled,)),
            steps.step(decode=(greedy,)),
            steps.step(leave=(greedy,)),
        ]
    return [
        steps.step(prefill=(greedy, sampled)),
        steps.step(decode=(greedy, sampled)),
        steps.step(decode=(greedy,), leave=(sampled,)),
        steps.step(leave=(greedy,)),
    ]
