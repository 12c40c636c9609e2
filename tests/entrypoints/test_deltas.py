"""What each streamed chunk carries, from the engine's cumulative outputs."""

from __future__ import annotations

import asyncio

from pagedkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedkv.entrypoints.openai.serving_engine import OpenAIServing


def cumulative(steps: list[tuple[str, list[int], str | None]]):
    async def outputs():
        for text, token_ids, finish_reason in steps:
            completion = CompletionOutput(0, text, token_ids, None, finish_reason)
            yield RequestOutput("r", None, [1], [completion], finish_reason is not None,
                                RequestMetrics(arrival_time=0.0))  # fmt: skip

    return outputs()


def test_a_step_whose_text_is_held_back_still_sends_its_tokens() -> None:
    """Text lags while bytes do not yet form a character or could start a stop string: those
    steps still stream (empty text, new tokens), as in vLLM, so a client's time to first token
    is the first token's, not the first visible character's."""

    async def collect():
        steps = [("", [7], None), ("", [7, 8], None), ("", [7, 8], None), ("é!", [7, 8, 9], "stop")]
        return [(d.text, d.token_ids) async for d in OpenAIServing.deltas([cumulative(steps)])]

    assert asyncio.run(collect()) == [("", [7]), ("", [8]), ("é!", [9])]
