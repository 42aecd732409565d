"""Streaming fan-out: a turn's readers, and the followers of a whole conversation.

A subscriber is a small buffer plus a future to wake it (far lighter than a
queue or a memory stream). Consecutive text deltas coalesce in the buffer, so a
slow reader costs at most the text not yet read, never one object per delta.

Two kinds of reader:

* a :class:`Subscriber` of one turn (what iterating a ``Turn`` reads): the
  turn's text and logged events; it ends when the turn finishes, suspends or
  aborts;
* a :class:`Follower` of a conversation (``Runtime.subscribe``): every event
  logged after a position, replayed from the log, then the text in flight,
  then everything live, across turns, until it is closed. Positions order the
  seam: an event at or below what the replay covered is never delivered twice.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Protocol, TypeAlias

from torpor.events import Aborted, AssistantMessage, Event
from torpor.llm.protocol import TextDelta

__all__ = ["Follower", "Origin", "StreamHub", "StreamItem", "Subscriber", "TurnDelta",
           "delta_turn"]


class TurnDelta(TextDelta, frozen=True, gc=False):
    """Text in flight, and the turn that streams it. A ``TextDelta`` (readers that only
    look for text need not know): a conversation's follower sees a user message of a
    later turn arrive while an answer streams, so text says which turn it belongs to."""

    turn: int


StreamItem: TypeAlias = TextDelta | Event
"""Live text (``TextDelta``, a ``TurnDelta`` from the runtime) or something durably logged
(``Event``)."""


def delta_turn(delta: TextDelta) -> int | None:
    """The turn a delta belongs to (None: a bare ``TextDelta``, which says nothing)."""
    return delta.turn if isinstance(delta, TurnDelta) else None


def _delta(text: str, turn: int | None) -> TextDelta:
    return TextDelta(text) if turn is None else TurnDelta(text, turn)


class Subscriber:
    """One reader of a turn's stream. Iterate it; it ends when the turn ends."""

    __slots__ = ("_closed", "_error", "_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[StreamItem] | None = None  # made on the first push (760 bytes)
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._error: BaseException | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def push(self, item: StreamItem) -> None:
        if self._closed:
            return
        items = self._items
        if items is None:
            items = self._items = deque()
        last = items[-1] if items else None
        if (isinstance(item, TextDelta) and isinstance(last, TextDelta)
                and delta_turn(last) == delta_turn(item)):
            items[-1] = _delta(last.text + item.text, delta_turn(item))
        else:
            items.append(item)
        self._wake()

    def close(self, error: BaseException | None = None) -> None:
        """End the stream after what is buffered (``error`` is raised after it)."""
        if not self._closed:
            self._closed = True
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> Subscriber:
        return self

    async def __anext__(self) -> StreamItem:
        # A method, not an async generator: an idle reader holds one coroutine frame, not
        # generator frames the event loop also tracks (about 1 KB less per idle follower).
        while (item := self.take()) is None:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return item

    def wake_on(self, future: asyncio.Future[None] | None) -> None:
        """Complete ``future`` when :meth:`take` has something again (an item, or the end);
        None: no longer. For a reader that waits on its own future, not by iterating."""
        self._waiter = future

    def take(self) -> StreamItem | None:
        """The next item without waiting, None if there is none yet; at the end, the error
        the stream was closed with, or StopAsyncIteration."""
        items = self._items
        if items:
            item = items.popleft()
            if not items:
                self._items = None  # drained: a long-lived follower keeps no empty deque
            return item
        if self._closed:
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        return None


class Origin(Protocol):
    """Where a follower's conversation is: its log, and who lets the follower go."""

    async def replay(self, conversation_id: str, position: int) -> list[Event]:
        """The events logged at or after ``position``."""
        ...

    def release(self, follower: Follower, conversation_id: str) -> None: ...


Replay: TypeAlias = bool | list[Event]
"""What a follower replays after its cursor: True, read it from the log (its origin's
``replay``); the events themselves when memory held them (up to its cut); False, nothing."""


class Follower(Subscriber):
    """Follows one conversation: the log after ``after``, the text in flight, then live.

    Registered the moment it is made, so nothing logged later can be missed; the
    replay is read lazily on the first iteration (unless memory held it: then it
    is given). ``cut`` is the highest position the replay must cover (the agent's
    head when it was made, if it was live); events pushed live at or below it are
    dropped, since the replay holds them. Close it (``close()``, or leave ``async
    with``) to release it at once; it also ends when the runtime stops. Iterating it
    again (after a ``break``) goes on where the last iteration stopped.
    """

    __slots__ = ("_after", "_cut", "_id", "_origin", "_replay")

    def __init__(
        self,
        origin: Origin,
        conversation_id: str,
        after: int | None,
        cut: int | None,
        replay: Replay,
    ) -> None:
        super().__init__()
        self._origin: Origin | None = origin  # None once released
        self._id = conversation_id
        self._after = after
        self._cut = cut
        self._replay: Replay = replay if after is not None else False

    def push(self, item: StreamItem) -> None:
        cut = self._cut
        if cut is not None and isinstance(item, Event) and item.position <= cut:
            return
        super().push(item)

    def close(self, error: BaseException | None = None) -> None:
        origin, self._origin = self._origin, None
        if origin is not None:
            origin.release(self, self._id)
        super().close(error)

    async def __aenter__(self) -> Follower:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __anext__(self) -> Coroutine[Any, Any, StreamItem]:
        # Not a coroutine itself: past the replay, the reader waits in Subscriber's frame only.
        if self._replay is not False:
            return self._replayed_then_next()
        return super().__anext__()

    async def _replayed_then_next(self) -> StreamItem:
        await self.replayed()
        # Subscriber.__anext__'s loop, here: awaiting it would keep two frames waiting.
        while (item := self.take()) is None:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return item

    async def replayed(self) -> None:
        """Read the replay now, if it is still to be read (iterating reads it first; a
        reader that only calls :meth:`take` calls this once before)."""
        replay, self._replay = self._replay, False
        origin, after = self._origin, self._after
        if replay is False or origin is None or after is None:
            return
        if isinstance(replay, list):
            events = replay
        else:
            try:
                events = await origin.replay(self._id, after + 1)
            except BaseException:
                self.close()
                raise
        cut = self._cut
        held = list(self._items or ())
        if cut is None:  # nothing was live: the replay covers all it read
            cut = events[-1].position if events else after
            self._cut = cut
            held = _after_replay(held, cut)
        # Kept on the follower, not in this coroutine: iterating it again (after a
        # ``break``) goes on where the last iteration stopped.
        items = [*(e for e in events if e.position <= cut), *held]
        self._items = deque(items) if items else None


def _after_replay(items: list[StreamItem], cut: int) -> list[StreamItem]:
    """What arrived live before a replay up to ``cut`` was read, minus what the replay holds.

    Events up to ``cut`` are in the replay. So is the text streamed for any answer
    it holds: deltas before the last replayed answer (or abort, which holds the
    partial text) would repeat it after its event. Deltas after that, and user
    messages logged mid-stream, belong to what is still in flight.
    """
    last_answer = -1
    for index, item in enumerate(items):
        if (
            isinstance(item, Event)
            and item.position <= cut
            and isinstance(item.body, AssistantMessage | Aborted)
        ):
            last_answer = index
    return [
        item
        for index, item in enumerate(items)
        if not (isinstance(item, Event) and item.position <= cut)
        and not (isinstance(item, TextDelta) and index < last_answer)
    ]


class StreamHub:
    """The fan-out of one turn: its subscribers, the conversation's followers, the text so far."""

    __slots__ = ("followers", "parts", "sealing", "subscribers", "turn")

    def __init__(self, followers: list[Follower] | None = None) -> None:
        self.subscribers: list[Subscriber] = []
        self.followers = followers  # the conversation's, shared with the runtime (None: none)
        self.parts: list[str] = []
        self.turn: int | None = None  # the turn whose text streams (set by the first delta)
        # The actor is writing (and then applying) this turn's own events, which hold the
        # text so far: once committed, that text is in the log, no longer in flight.
        self.sealing = False

    def join(self) -> Subscriber:
        """A new subscriber; it first receives the text streamed so far, then live deltas."""
        sub = Subscriber()
        if self.parts:
            sub.push(self.in_flight())
        self.subscribers.append(sub)
        return sub

    def in_flight(self) -> TextDelta:
        """The text streamed so far, as one delta of its turn."""
        return _delta("".join(self.parts), self.turn)

    def text(self, delta: str, turn: int | None = None) -> None:
        self.parts.append(delta)
        self.turn = turn
        item = _delta(delta, turn)
        for sub in self.subscribers:
            sub.push(item)
        followers = self.followers
        if followers:
            for follower in followers:
                follower.push(item)

    def logged(self, event: Event) -> None:
        """A durable event of this turn (followers get it from the runtime, once)."""
        self.parts.clear()
        for sub in self.subscribers:
            sub.push(event)

    def close(self, error: BaseException | None = None) -> None:
        for sub in self.subscribers:
            sub.close(error)
        self.subscribers.clear()
        self.parts.clear()
