"""Several requests' output streams as one (a batch of prompts answered in one SSE stream)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

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
