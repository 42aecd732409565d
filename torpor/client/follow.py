"""Following a whole conversation, as long as the caller likes, through dropped connections."""

from __future__ import annotations

from types import TracebackType

from torpor.client.items import Item, decode_item
from torpor.client.stream import ResumingStream, StreamOver

__all__ = ["Follow"]


class Follow:
    """``async for item in follow``: every item of the conversation after the cursor it
    started from, live, each once, reconnecting (from :attr:`last_id`) whenever the
    connection drops. ``last_id`` is where to start again later (``follow(after=…)``).

    The stream opens on ``async with`` (so "from now", ``after=None``, means from
    there), else on the first iteration."""

    __slots__ = ("_stream", "conversation_id")

    def __init__(self, stream: ResumingStream, conversation_id: str) -> None:
        self._stream = stream
        self.conversation_id = conversation_id

    @property
    def last_id(self) -> str | None:
        return self._stream.last_id

    def __aiter__(self) -> Follow:
        return self

    async def __anext__(self) -> Item:
        if self._stream.closed:
            raise StopAsyncIteration
        try:
            event = await self._stream.next()
        except StreamOver:  # the server has nothing more for this cursor
            raise StopAsyncIteration from None
        except Exception:  # a typed error or ServerUnreachable: the stream is over
            await self._stream.aclose()
            raise
        return decode_item(event.event, event.data, event.id, self.conversation_id)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> Follow:
        try:
            await self._stream.connect()
        except StreamOver:
            pass  # nothing follows: the first iteration ends
        except Exception:
            await self._stream.aclose()
            raise
        return self

    async def __aexit__(self, kind: type[BaseException] | None, value: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
