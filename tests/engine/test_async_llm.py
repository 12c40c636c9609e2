"""AsyncLLM: a background engine thread, batched concurrent requests, abort, shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from pagedkv import EngineArgs, SamplingParams
from pagedkv.engine.async_llm import AsyncLLM, EngineDeadError
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.request_input import RequestInput
from pagedkv.engine.scheduler_stats import SchedulerStats
from pagedkv.sampling_params import RequestOutputKind
from tests.engine.conftest import assert_all_blocks_free
from tests.tiny_models import random_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class RecordingStatLogger:
    def __init__(self) -> None:
        self.stats: SchedulerStats | None = None
        self.finished: list[RequestOutput] = []

    def record(self, stats: SchedulerStats, finished: list[RequestOutput]) -> None:
        self.stats = stats
        self.finished.extend(finished)


@pytest.fixture
def async_llm(checkpoint):
    llm = AsyncLLM(
        EngineArgs(model=str(checkpoint("llama")), max_num_seqs=32), [RecordingStatLogger()]
    )
    yield llm
    llm.shutdown()
    assert_all_blocks_free(llm)  # the thread is gone: its engine may be inspected


async def collect(stream) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    return last


def test_concurrent_requests_share_steps_and_match_offline(async_llm, make_llm) -> None:
    prompts = [random_prompt(5 + i % 7, seed=i) for i in range(16)]

    async def run() -> list[RequestOutput]:
        return await asyncio.gather(
            *(collect(async_llm.generate(RequestInput(p, GREEDY))) for p in prompts)
        )

    outputs = asyncio.run(run())
    offline = make_llm("llama").generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in offline]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    stats = async_llm.stat_loggers[0].stats
    assert stats.max_batch_size > 1 and stats.num_batched_steps > 0
    assert len(async_llm.stat_loggers[0].finished) == len(prompts)


def test_outputs_stream_cumulatively(async_llm) -> None:
    async def run() -> list[list[int]]:
        return [
            list(o.outputs[0].token_ids)
            async for o in async_llm.generate(RequestInput([7, 8, 9], GREEDY))
        ]

    seen = asyncio.run(run())
    assert all(a == b[: len(a)] for a, b in zip(seen, seen[1:]))
    assert len(seen[-1]) == GREEDY.max_tokens


def test_a_slow_reader_of_deltas_gets_them_merged_not_dropped(async_llm) -> None:
    """Deltas that pile up while the reader is busy arrive as one, with nothing lost."""
    params = dataclasses.replace(GREEDY, n=2, max_tokens=24, output_kind=RequestOutputKind.DELTA)
    prompt = random_prompt(10, seed=4)

    async def run() -> tuple[list[RequestOutput], RequestOutput]:
        deltas = []
        async for output in async_llm.generate(RequestInput(prompt, params)):
            deltas.append(output)
            await asyncio.sleep(0.05)  # several engine steps
        full = await collect(
            async_llm.generate(
                RequestInput(
                    prompt, dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE)
                )
            )
        )
        return deltas, full

    deltas, full = asyncio.run(run())
    assert len(deltas) < 2 * params.max_tokens  # outputs were merged
    for completion in full.outputs:
        pieces = [c for d in deltas for c in d.outputs if c.index == completion.index]
        assert [t for c in pieces for t in c.token_ids] == completion.token_ids
        assert "".join(c.text for c in pieces) == completion.text
        assert [c.finish_reason for c in pieces if c.finish_reason] == ["length"]


def test_bad_input_raises_in_the_caller(async_llm) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="prompt must not be empty"):
            async_llm.add_request(RequestInput([], GREEDY))
        with pytest.raises(ValueError, match="prompt token ids"):
            async_llm.add_request(RequestInput([1, 100000], GREEDY))
        with pytest.raises(ValueError, match="stop_token_ids"):
            async_llm.add_request(RequestInput([1, 2], SamplingParams(stop_token_ids=[256])))
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=2**64)  # beyond what a torch generator takes
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(async_llm.generate(RequestInput([1] * 1000, GREEDY)))
        stream = async_llm.add_request(RequestInput([1, 2], GREEDY, request_id="dup"))
        taken = async_llm.add_request(RequestInput([1, 2], GREEDY, request_id="dup"))
        await collect(stream)
        with pytest.raises(ValueError, match="already in use"):
            await collect(taken)

    asyncio.run(run())


def test_leaving_a_stream_aborts_and_frees_blocks(async_llm) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    stat_logger = async_llm.stat_loggers[0]

    async def run() -> None:
        async for output in async_llm.generate(RequestInput(random_prompt(40, seed=1), long)):
            if len(output.outputs[0].token_ids) >= 2:
                assert stat_logger.stats.kv_cache_usage > 0
                break
        for _ in range(3000):
            if stat_logger.finished:
                break
            await asyncio.sleep(0.01)

    asyncio.run(run())
    (aborted,) = stat_logger.finished
    assert aborted.outputs[0].finish_reason == "abort"
    assert stat_logger.stats.kv_cache_usage == 0 and stat_logger.stats.num_running_reqs == 0


def test_idle_engine_thread_does_not_spin(async_llm) -> None:
    asyncio.run(collect(async_llm.generate(RequestInput([1, 2, 3], GREEDY))))
    start = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - start < 0.1  # polling every millisecond costs far more


def test_shutdown_ends_streams_with_engine_dead_error(async_llm) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run() -> None:
        stream = async_llm.add_request(RequestInput([1, 2, 3], long))
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                async_llm.shutdown()
        with pytest.raises(EngineDeadError):
            async_llm.add_request(RequestInput([1, 2, 3], long))

    asyncio.run(run())
    assert not async_llm.is_running
    # Shutdown keeps the engine as it was; free what the interrupted request held.
    async_llm.llm_engine.abort_request(list(async_llm.llm_engine.scheduler.requests))


def test_a_refused_stream_does_not_abort_the_request_holding_its_id(async_llm) -> None:
    """A second request under a live id is refused; if its reader leaves before the refusal
    arrives, the stream's abort must not hit the first request (it once did: abort by id)."""
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def run() -> RequestOutput:
        first = async_llm.add_request(RequestInput([1, 2, 3], long, request_id="dup"))
        outputs = aiter(first)
        await anext(outputs)  # running
        release = threading.Event()
        async_llm._commands.put(release.wait)  # hold the engine thread between two steps
        refused = asyncio.ensure_future(
            collect(async_llm.add_request(RequestInput([4, 5], long, request_id="dup")))
        )
        await asyncio.sleep(0.05)  # its reader waits: the engine has not refused it yet
        refused.cancel()  # the client goes away: the stream's abort is queued
        release.set()
        return await collect(outputs)

    final = asyncio.run(run())
    assert final.outputs[0].finish_reason == "length"
    assert len(final.outputs[0].token_ids) == long.max_tokens
