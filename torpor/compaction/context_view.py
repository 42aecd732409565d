"""A rendered context that shares the render cache's message list instead of copying it.

Every model call rendered its context into a new list: the system messages,
then a copy of every tail message, then the per-call ones. The copy touched
each message once to take a reference and once more to drop it after the call,
so a call cost O(tail) in reference counting alone, with a cache miss per
message when many conversations take turns. A :class:`MessageView` is the same
sequence over three parts: the leading messages, the first ``n`` messages of
the cache's list, and the trailing ones. Iterating it chains them in C.

The cache's list only grows after a render, except where a slot changes in
place (a stub, a clip); the cache copies its list before such a change while a
view may still read it (:class:`~torpor.compaction.incremental.TailCache`), so
a view never changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import chain, islice
from typing import overload

from torpor.llm.protocol import ContextMessage

__all__ = ["MessageView"]


class MessageView(Sequence[ContextMessage]):
    """``head + body[:n] + after``, read-only, without copying ``body``."""

    __slots__ = ("_after", "_body", "_head", "_n")

    def __init__(
        self,
        head: list[ContextMessage],
        body: list[ContextMessage],
        n: int,
        after: list[ContextMessage],
    ) -> None:
        self._head = head
        self._body = body
        self._n = n
        self._after = after

    def __len__(self) -> int:
        return len(self._head) + self._n + len(self._after)

    def __iter__(self) -> Iterator[ContextMessage]:
        return chain(self._head, islice(self._body, self._n), self._after)

    def __reversed__(self) -> Iterator[ContextMessage]:
        # In C too (Sequence's own would index the view once per message, in Python):
        # models read a context backwards for its last user message.
        body = map(self._body.__getitem__, range(self._n - 1, -1, -1))
        return chain(reversed(self._after), body, reversed(self._head))

    @overload
    def __getitem__(self, index: int) -> ContextMessage: ...

    @overload
    def __getitem__(self, index: slice) -> list[ContextMessage]: ...

    def __getitem__(self, index: int | slice) -> ContextMessage | list[ContextMessage]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return list(self)[index]
            return self._span(start, max(start, stop))
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("context index out of range")
        head = len(self._head)
        if index < head:
            return self._head[index]
        index -= head
        if index < self._n:
            return self._body[index]
        return self._after[index - self._n]

    def _span(self, start: int, stop: int) -> list[ContextMessage]:
        """``list(self)[start:stop]`` (0 <= start <= stop <= len), reading only that span."""
        head, n = len(self._head), self._n
        out = self._head[start:stop] if start < head else []
        a, b = max(start - head, 0), min(stop - head, n)
        if a < b:
            out += self._body[a:b]
        a, b = max(start - head - n, 0), stop - head - n
        if a < b:
            out += self._after[a:b]
        return out

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MessageView | list | tuple):
            return len(self) == len(other) and all(
                a == b for a, b in zip(self, other, strict=True)
            )
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return f"MessageView({list(self)!r})"
