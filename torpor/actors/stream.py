"""Streaming fan-out: every subscriber of a turn gets every delta, late joiners included.

A subscriber is a small buffer plus a future to wake it (far lighter than a
queue or a memory stream). Consecutive text deltas coalesce in the buffer, so a
slow reader costs at most the text of the turn, never one object per delta.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import TypeAlias

from torpor.events import Event
from torpor.llm.protocol import TextDelta

__all__ = ["StreamHub", "StreamItem", "Subscriber"]

StreamItem: TypeAlias = TextDelta | Event
"""Live text (``TextDelta``) or something durably logged (``Event``)."""


class Subscriber:
    """One reader of a turn's stream. Iterate it; it ends when the turn ends."""

    __slots__ = ("_closed", "_error", "_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[StreamItem] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._error: BaseException | None = None

    def push(self, item: StreamItem) -> None:
        if self._closed:
            return
        items = self._items
        if items and isinstance(item, TextDelta) and isinstance(items[-1], TextDelta):
            items[-1] = TextDelta(items[-1].text + item.text)
        else:
            items.append(item)
        self._wake()

    def close(self, error: BaseException | None = None) -> None:
        if not self._closed:
            self._closed = True
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> AsyncIterator[StreamItem]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamItem]:
        while True:
            while self._items:
                yield self._items.popleft()
            if self._closed:
                if self._error is not None:
                    raise self._error
                return
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class StreamHub:
    """The fan-out of one turn: its subscribers and the text streamed so far this call."""

    __slots__ = ("parts", "subscribers")

    def __init__(self) -> None:
        self.subscribers: list[Subscriber] = []
        self.parts: list[str] = []

    def join(self) -> Subscriber:
        """A new subscriber; it first receives the text streamed so far, then live deltas."""
        sub = Subscriber()
        if self.parts:
            sub.push(TextDelta("".join(self.parts)))
        self.subscribers.append(sub)
        return sub

    def text(self, delta: str) -> None:
        self.parts.append(delta)
        item = TextDelta(delta)
        for sub in self.subscribers:
            sub.push(item)

    def logged(self, event: Event) -> None:
        """A durable event of this turn; the streamed text it finalizes is reset."""
        self.parts.clear()
        for sub in self.subscribers:
            sub.push(event)

    def close(self, error: BaseException | None = None) -> None:
        for sub in self.subscribers:
            sub.close(error)
        self.subscribers.clear()
        self.parts.clear()
