"""Turn: the caller's handle on one turn, returned once its user message is durable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from torpor.actors.stream import StreamItem, Subscriber
from torpor.events import AssistantMessage

__all__ = ["Turn"]


class Turn:
    """An async-iterable stream of the turn's items; ``await result()`` for the final answer.

    Iterating yields live ``TextDelta``s and the turn's logged ``Event``s (tool
    calls, tool results, suspension, the final message or the abort). The final
    answer is the last assistant message without tool calls; a turn that dies
    raises ``TurnAborted`` from ``result()`` (and from the iteration).
    """

    __slots__ = ("_result", "_sub", "conversation_id", "number", "replayed", "user_position")

    def __init__(
        self,
        conversation_id: str,
        number: int,
        user_position: int,
        subscriber: Subscriber,
        *,
        replayed: bool = False,
    ) -> None:
        self.conversation_id = conversation_id
        self.number = number
        self.user_position = user_position
        self.replayed = replayed  # an idempotent retry of an earlier send
        self._sub = subscriber
        self._result: asyncio.Future[AssistantMessage] = (
            asyncio.get_running_loop().create_future()
        )

    def __aiter__(self) -> AsyncIterator[StreamItem]:
        return self._sub.__aiter__()

    async def result(self) -> AssistantMessage:
        return await asyncio.shield(self._result)

    def done(self) -> bool:
        return self._result.done()

    def _finish(self, message: AssistantMessage) -> None:
        if not self._result.done():
            self._result.set_result(message)
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
