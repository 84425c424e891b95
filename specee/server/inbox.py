"""Where the worker thread delivers the events of a request's jobs, for the handler's event loop.

Each delivery wakes the loop, and the loop's work (a chunk shaped and sent, then read by a client
that is often on the same machine) runs beside the next pass, on the pass's cores. So a request
that is not streamed takes only its jobs' ends, and a streamed one gets its first event at once
and the later ones gathered, at most every STREAM_INTERVAL_S (plus a pass).
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable

from ..engine import Event
from .scheduler import Ended

# A streamed answer's events after the first are sent together at most this often.
STREAM_INTERVAL_S = 0.05


class Inbox:
    def __init__(self, choices: int = 1, streamed: bool = True) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event | Ended]] = asyncio.Queue()
        self.choices = choices
        self.streamed = streamed

    def deliverer(self, index: int) -> Callable[[Event | Ended], None]:
        """The callback through which choice `index`'s job delivers, from the worker thread (the
        only caller: what it holds needs no lock)."""
        held: list[Event | Ended] = []
        sent_at = [float("-inf")]  # the latest delivery's time.monotonic(): none yet, so the first goes at once

        def deliver(item: Event | Ended) -> None:
            if not self.streamed and not isinstance(item, Ended):
                return
            held.append(item)
            now = time.monotonic()
            if not isinstance(item, Ended) and now - sent_at[0] < STREAM_INTERVAL_S:
                return
            items, sent_at[0] = held[:], now
            held.clear()
            try:
                self.loop.call_soon_threadsafe(self._put, index, items)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                pass
        return deliver

    def _put(self, index: int, items: list[Event | Ended]) -> None:
        for item in items:
            self.queue.put_nowait((index, item))

    def ready(self) -> bool:
        """Whether more has been delivered already (to send together with what was just read)."""
        return not self.queue.empty()

    async def events(self) -> AsyncIterator[tuple[int, Event | Ended]]:
        """(choice, event or end) until every choice has ended."""
        ended = 0
        while ended < self.choices:
            index, item = await self.queue.get()
            ended += isinstance(item, Ended)
            yield index, item
