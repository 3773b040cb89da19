"""The outputs of one request of an :class:`~cbatch.core.async_engine.AsyncEngine`, as an
async iterator: the engine thread puts them on the stream's queue, the caller's event loop
reads them.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from cbatch.outputs import RequestOutput


class RequestStream:
    """The outputs of one request, in order, the last one ``finished``.

    Stopping early (``aclose()``, a cancelled ``await``, or dropping the stream, as a
    caller does that leaves its ``async for`` and lets go of it) aborts the request and frees
    its KV blocks.
    """

    def __init__(self, abort: Callable[[str], None], request_id: str, queue: asyncio.Queue):
        self.request_id = request_id
        self._abort = abort  # AsyncEngine.abort
        self._queue = queue
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the caller went away
            self.abort()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    def __del__(self) -> None:
        self.abort()
