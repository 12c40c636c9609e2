"""Several requests' output streams as one: merged as outputs arrive (a batch of prompts answered
in one SSE stream), or their final outputs together (a whole answer)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest

from pagedkv.engine.async_llm import RequestStream
from pagedkv.engine.outputs import RequestOutput


async def merge_streams(
    streams: list[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(i, output)`` from all streams as outputs arrive. Leaving early (a client gone) leaves
    every stream's iteration, which aborts the requests still running."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as e:  # delivered to the reader, which raises it
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        num_open = len(tasks)
        while num_open:
            i, item = await queue.get()
            if item is done:
                num_open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def final_outputs(
    streams: list[RequestStream], raw_request: HTTPRequest
) -> list[RequestOutput] | None:
    """Each request's last output, or None if the client disconnected first (the requests
    are aborted then: leaving a stream's iteration aborts it)."""

    async def last(stream: RequestStream) -> RequestOutput:
        final = None
        async for output in stream:
            final = output
        return final

    async def disconnected() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    generation = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
    watcher = asyncio.ensure_future(disconnected())
    done: set[asyncio.Future] = set()
    try:
        done, _ = await asyncio.wait({generation, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not generation.done():
            # cancel() only asks: wait until the streams have left their iteration (and
            # aborted their requests), so nothing is left to fail unobserved.
            generation.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await generation
    if generation in done:
        return generation.result()
    return None
