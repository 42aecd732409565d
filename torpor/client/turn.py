"""A turn in flight: its own items as they come, then its outcome.

``async for item in turn`` yields the turn's items: its logged events
(:class:`torpor.events.Event`) and the deltas of its answer (:class:`Delta`),
through dropped connections (the stream resumes after the last event id, asking
the server for this turn alone: ``?turn=N``). A server that still streams other
turns' items (one that predates turn-scoped streams) is filtered here: a logged
event by its ``turn``, a delta by its ``turn`` or, from a server that does not tag
deltas, by the turn whose events surround it.

``await turn.result()`` reads what is left and returns the turn's end: the final
:class:`~torpor.events.AssistantMessage` or the :class:`~torpor.events.Suspended`
that waits for answers, or raises :class:`~torpor.TurnAborted` with the abort's
fields (``error_type``, ``retryable``, ``retry_after``, ``status``, ``message``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType

from torpor.client.items import Delta, Item, decode_item, ends_turn, turn_aborted
from torpor.client.problems import HTTPError, Problem
from torpor.client.stream import ResumingStream, StreamOver
from torpor.events import Aborted, AssistantMessage, Event, Suspended

__all__ = ["Turn", "TurnFilter"]


class TurnFilter:
    """Which items belong to turn ``number``; seen in stream order."""

    __slots__ = ("_last_position", "_running", "number")

    def __init__(self, number: int) -> None:
        self.number = number
        self._running: int | None = None  # the turn whose answer streams, when known
        self._last_position = -1

    def mine(self, item: Item) -> bool:
        if isinstance(item, Event):
            if item.position <= self._last_position:
                return False  # already seen (positions only grow along a stream)
            self._last_position = item.position
            if item.kind != "user":
                self._running = None if ends_turn(item, item.turn) else item.turn
            return item.turn == self.number
        if isinstance(item, Delta):
            turn = item.turn
            if turn is None:  # a server that does not tag deltas: the turn in progress
                turn = self._running if self._running is not None else self.number
            return turn == self.number
        turn = item.data.get("turn") if isinstance(item.data, dict) else None
        return turn is None or turn == self.number


class Turn:
    """One turn of a conversation, from its start (see the module doc)."""

    __slots__ = ("_end", "_filter", "_find_end", "_pending", "_stream", "conversation_id",
                 "key")

    def __init__(self, stream: ResumingStream, conversation_id: str, number: int,
                 key: str | None, pending: Iterable[Item] = (), *,
                 find_end: Callable[[int], Awaitable[Event | None]] | None = None) -> None:
        self._stream = stream
        self._find_end = find_end  # the turn's logged end, when the server says it is over
        self.conversation_id = conversation_id
        self.key = key
        self._filter = TurnFilter(number)
        self._pending = deque(item for item in pending if self._filter.mine(item))
        self._end: Event | None = None

    @property
    def number(self) -> int:
        """The turn's number (the ``turn`` of its events)."""
        return self._filter.number

    @property
    def last_id(self) -> str | None:
        """The id of the last event received: where a new stream would resume."""
        return self._stream.last_id

    @property
    def done(self) -> bool:
        """Whether the turn's end (answer, suspension or abort) was received."""
        return self._end is not None

    def __aiter__(self) -> Turn:
        return self

    async def __anext__(self) -> Item:
        if self._pending:
            return self._took(self._pending.popleft())
        if self._end is not None:
            await self._stream.aclose()  # the turn is over: let its connection go
            raise StopAsyncIteration
        while True:
            try:
                event = await self._stream.next()
            except StreamOver:
                # resumed from past the turn's end (``turn(after=…)``): read it from the log
                self._end = await self._find_end(self.number) if self._find_end else None
                if self._end is None:
                    raise HTTPError(Problem(204, "TurnOver", f"turn {self.number} is over "
                                            "and its end was not found")) from None
                raise StopAsyncIteration from None
            except Exception:  # a typed error or ServerUnreachable: the stream is over
                await self._stream.aclose()
                raise
            item = decode_item(event.event, event.data, event.id, self.conversation_id)
            if self._filter.mine(item):
                return self._took(item)

    def _took(self, item: Item) -> Item:
        if isinstance(item, Event) and ends_turn(item, self.number):
            self._end = item
        return item

    async def result(self) -> AssistantMessage | Suspended:
        """The turn's end, once it came (reading the items not iterated yet); an abort
        raises :class:`~torpor.TurnAborted`."""
        try:
            while self._end is None:
                await self.__anext__()
        finally:
            if self._end is not None:
                await self.aclose()
        body = self._end.body
        if isinstance(body, Aborted):
            raise turn_aborted(body)
        assert isinstance(body, AssistantMessage | Suspended)
        return body

    async def aclose(self) -> None:
        """Stop following the turn (the turn itself runs on: cancel it with ``cancel``)."""
        await self._stream.aclose()

    async def __aenter__(self) -> Turn:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, value: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

