"""Turn: the caller's handle on one turn, returned once its user message is durable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import TracebackType

from torpor.actors.stream import StreamItem, Subscriber
from torpor.events import AssistantMessage, Suspended

__all__ = ["Turn"]


class Turn:
    """An async-iterable stream of the turn's items; ``await result()`` for how it ended.

    Iterating yields live ``TextDelta``s and the turn's logged ``Event``s (tool
    calls, tool results, the final message, a suspension or the abort). The
    stream ends with the final answer, or at a suspension: ``result()`` then
    returns the ``Suspended`` body (its ``call_ids`` are what ``resolve``
    answers), and the continuation after the answers is a new ``Turn``, which
    ``resolve`` returns and ``Runtime.subscribe`` follows. A turn that dies
    raises ``TurnAborted`` from ``result()`` and from the iteration.

    ``postponed``: the message arrived while another turn was open (streaming or
    suspended); it is in the log already and its turn runs when that one ends.
    """

    __slots__ = (
        "_blocked",
        "_error",
        "_outcome",
        "_sub",
        "_traceback",
        "_waiters",
        "continuation",
        "conversation_id",
        "number",
        "origin",
        "postponed",
        "replayed",
        "user_position",
    )

    def __init__(
        self,
        conversation_id: str,
        number: int,
        user_position: int,
        subscriber: Subscriber,
        *,
        replayed: bool = False,
        postponed: bool = False,
        continuation: bool = False,
    ) -> None:
        self.conversation_id = conversation_id
        self.number = number
        self.user_position = user_position
        self.replayed = replayed  # an idempotent retry of an earlier send
        self.postponed = postponed
        self.continuation = continuation  # the part after a suspension was answered
        self.origin: object | None = None  # the sender's trace (Observer.origin), if any
        self._sub = subscriber
        # How it ended, and who waits to learn it: plain slots, not a future the callers
        # would each have to shield (a shield costs two callbacks and a loop pass more).
        self._outcome: AssistantMessage | Suspended | None = None
        self._error: BaseException | None = None
        self._traceback: TracebackType | None = None
        self._waiters: list[asyncio.Future[None]] | None = None
        # Set while a postponed turn cannot run because the store refuses writes: result()
        # raises it then instead of waiting for the store (it may succeed when called later).
        self._blocked: BaseException | None = None

    def __aiter__(self) -> AsyncIterator[StreamItem]:
        return self._sub.__aiter__()

    async def result(self) -> AssistantMessage | Suspended:
        """The final message, or the ``Suspended`` this part of the turn stopped at.

        Cancelling this wait cancels only the wait, never the turn. A postponed turn
        that cannot run while the store refuses writes raises ``StoreUnavailable``: it
        stays in the log and runs once the store writes again (call again then).
        """
        if self._blocked is not None and not self.done():
            raise self._blocked.with_traceback(None)  # shared: no frames piled up on it
        if self._outcome is None and self._error is None:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if self._waiters is None:
                self._waiters = [waiter]
            else:
                self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:  # this wait only: the others still get woken
                waiters = self._waiters
                if waiters is not None and waiter in waiters:
                    waiters.remove(waiter)
                raise
        if self._error is not None:
            raise self._error.with_traceback(self._traceback)
        assert self._outcome is not None
        return self._outcome

    def done(self) -> bool:
        return self._outcome is not None or self._error is not None

    def _finish(self, outcome: AssistantMessage | Suspended) -> None:
        if not self.done():
            self._outcome = outcome
            self._wake()
        self._sub.close()

    def _fail(self, error: BaseException) -> None:
        if not self.done():
            self._error = error
            self._traceback = error.__traceback__
            self._wake()
        self._sub.close(error)

    def _block(self, error: BaseException | None) -> None:
        """``error``: the turn cannot run for now (its waiters get it, and so does every
        result() until unblocked); None: it can again."""
        self._blocked = error
        if error is None or self.done():
            return
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_exception(error)
                waiter.exception()  # a caller that gave up must not leave "never retrieved"

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<Turn {self.conversation_id!r} #{self.number} {state}>"
