"""Turn: the caller's handle on one turn, returned once its user message is durable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

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
        "_result",
        "_sub",
        "continuation",
        "conversation_id",
        "number",
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
        self._sub = subscriber
        self._result: asyncio.Future[AssistantMessage | Suspended] = (
            asyncio.get_running_loop().create_future()
        )

    def __aiter__(self) -> AsyncIterator[StreamItem]:
        return self._sub.__aiter__()

    async def result(self) -> AssistantMessage | Suspended:
        """The final message, or the ``Suspended`` this part of the turn stopped at."""
        return await asyncio.shield(self._result)

    def done(self) -> bool:
        return self._result.done()

    def _finish(self, outcome: AssistantMessage | Suspended) -> None:
        if not self._result.done():
            self._result.set_result(outcome)
        self._sub.close()

    def _fail(self, error: BaseException) -> None:
        if not self._result.done():
            self._result.set_exception(error)
            # A caller that never awaits result() must not get "exception never retrieved".
            self._result.exception()
        self._sub.close(error)

    def __repr__(self) -> str:
        state = "done" if self._result.done() else "running"
        return f"<Turn {self.conversation_id!r} #{self.number} {state}>"
