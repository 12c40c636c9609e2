"""What each streamed chunk carries: the server's ``deltas`` over a real engine's ``DELTA``
outputs, against the same requests' whole answers."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from pagedkv import EngineArgs, SamplingParams
from pagedkv.engine.async_llm import AsyncLLM
from pagedkv.engine.request_input import RequestInput
from pagedkv.entrypoints.openai.serving_engine import OpenAIServing
from pagedkv.sampling_params import RequestOutputKind


@pytest.fixture
def async_llm(tiny_model: Path):
    llm = AsyncLLM(EngineArgs(model=str(tiny_model), max_num_seqs=16))
    yield llm
    llm.shutdown()


def test_chunks_join_into_each_choices_whole_answer(async_llm) -> None:
    """Two prompts with ``n=2`` in one stream (choice ``i * n + j``), with a stop string: each
    choice's chunks join into its whole answer, a chunk may carry tokens whose text is still
    held back (as in vLLM, so a client sees each step), and each choice finishes once."""
    prompts = ["w1 w2", "w7"]
    # The long stop string holds back up to 13 characters of text: several tokens' worth.
    whole = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=14, stop=["w5 w6 w7 w8 w9"])
    streamed = dataclasses.replace(whole, output_kind=RequestOutputKind.DELTA)

    async def run():
        finals = [await last(async_llm.generate(RequestInput(p, whole))) for p in prompts]
        streams = [async_llm.add_request(RequestInput(p, streamed)) for p in prompts]
        return finals, [d async for d in OpenAIServing.deltas(streams, n=2)]

    async def last(stream):
        return [output async for output in stream][-1]

    finals, deltas = asyncio.run(run())
    for i, final in enumerate(finals):
        for completion in final.outputs:
            chunks = [d for d in deltas if d.index == i * 2 + completion.index]
            assert "".join(d.text for d in chunks) == completion.text
            assert [t for d in chunks for t in d.token_ids] == completion.token_ids
            assert [d.finish_reason for d in chunks if d.finish_reason] == [
                completion.finish_reason
            ]
    assert all(d.token_ids or d.text or d.finish_reason for d in deltas)
    assert any(d.token_ids and not d.text for d in deltas)  # text held back, tokens sent
