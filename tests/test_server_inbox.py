"""How the worker's deliveries reach a request's handler: a streamed answer's first event at once
and the later ones gathered; an answer that is not streamed, its end only."""
import asyncio
from types import SimpleNamespace

from specee.server import inbox as inbox_module
from specee.server.inbox import STREAM_INTERVAL_S, Inbox
from specee.server.scheduler import Ended


def drained(box: Inbox) -> list:
    items = []
    while box.ready():
        items.append(box.queue.get_nowait()[1])
    return items


def test_a_streamed_answers_first_event_goes_at_once_and_later_ones_together(monkeypatch):
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(inbox_module, "time", SimpleNamespace(monotonic=lambda: clock.now))

    async def main():
        box = Inbox(1, streamed=True)
        deliver = box.deliverer(0)
        seen = []

        async def at(seconds, item):
            clock.now = 100.0 + seconds
            deliver(item)
            await asyncio.sleep(0)  # the loop runs what the worker handed it
            seen.append(drained(box))

        await at(0.0, "first")
        await at(0.2 * STREAM_INTERVAL_S, "second")
        await at(0.4 * STREAM_INTERVAL_S, "third")
        await at(1.1 * STREAM_INTERVAL_S, "fourth")  # the interval has passed: the held ones go with it
        await at(1.2 * STREAM_INTERVAL_S, "fifth")
        end = Ended("finished")
        await at(1.3 * STREAM_INTERVAL_S, end)  # the end takes everything held with it
        return seen, end

    seen, end = asyncio.run(main())
    assert seen == [["first"], [], [], ["second", "third", "fourth"], [], ["fifth", end]]


def test_an_answer_not_streamed_is_delivered_its_end_only():
    async def main():
        box = Inbox(2, streamed=False)
        first, second = box.deliverer(0), box.deliverer(1)
        ends = Ended("finished"), Ended("error", message="boom")
        for item in ("a", "b", ends[0]):
            first(item)
        for item in ("c", ends[1]):
            second(item)
        got = [pair async for pair in box.events()]
        return got, ends

    got, ends = asyncio.run(main())
    assert got == [(0, ends[0]), (1, ends[1])]
