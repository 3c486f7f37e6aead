"""asyncio helpers the server needs.

Mirrors vllm/utils/async_utils.py (``merge_async_iterators``): a completion
request with several prompts runs one ``generate()`` per prompt, and their
outputs are read as they come, whichever prompt they belong to.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncGenerator[tuple[int, T]]:
    """Yield ``(i, item)`` from all the iterators, in the order items arrive.

    When the merged iterator is closed early (a client hung up), every
    iterator still running is closed too, so each aborts its request.
    """
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()  # type: ignore[attr-defined]
        return
    loop = asyncio.get_running_loop()
    awaits: dict[asyncio.Task[T], tuple[int, AsyncIterator[T]]] = {
        loop.create_task(anext(it)): (i, it)  # type: ignore[arg-type]
        for i, it in enumerate(iterators)
    }
    try:
        while awaits:
            done, _ = await asyncio.wait(awaits.keys(), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i, it = awaits.pop(task)
                try:
                    item = await task
                except StopAsyncIteration:
                    continue
                awaits[loop.create_task(anext(it))] = (i, it)  # type: ignore[arg-type]
                yield i, item
    finally:
        for task, (_, it) in awaits.items():
            with contextlib.suppress(BaseException):
                task.cancel()
                await it.aclose()  # type: ignore[attr-defined]
