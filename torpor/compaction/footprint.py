"""What a working set's objects weigh, one object at a time.

The runtime's memory high-water mark adds up every agent's estimate after every
turn, so the estimate must not cost a walk over the tail: the working set keeps
running totals of these per-object sizes, added when an event arrives and
recounted when a fold drops events. The same functions serve a from-scratch walk
(``walk_bytes``) that tests compare the running totals against.

Strings are sized as they are once rendered: CPython keeps a UTF-8 copy inside
a non-ASCII ``str`` from the first time tiktoken or msgspec asks for it, so
``sys.getsizeof`` of the same text grows when it is first sent. Counting that
copy from the start keeps a running total equal to a later walk (and is what
the memory holds once the agent has talked).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torpor.events import (
    Aborted,
    AssistantMessage,
    Event,
    Parked,
    Resolved,
    Suspended,
    ToolResult,
    Unparked,
    UserMessage,
)
from torpor.store.protocol import Checkpoint

__all__ = ["checkpoint_bytes", "event_bytes", "str_bytes", "tail_bytes"]

_COMPACT = sys.getsizeof(chr(0xE9) * 2) - 3  # header of a non-ASCII str (no UTF-8 copy yet)

# Structs have a fixed size per type (no variable part): measured once, not per event.
_EVENT = sys.getsizeof(Event("", 0, 0, 0, 0, UserMessage("")))
_BODY = {
    kind: sys.getsizeof(sample)
    for kind, sample in (
        (UserMessage, UserMessage("")),
        (AssistantMessage, AssistantMessage("")),
        (ToolResult, ToolResult("", "", "")),
        (Aborted, Aborted("cancelled")),
        (Suspended, Suspended(())),
        (Resolved, Resolved("")),
        (Parked, Parked("")),
        (Unparked, Unparked()),
    )
}
_SMALL_INT = 256  # CPython shares the ints up to here: they cost an event nothing
_sizeof = sys.getsizeof


def str_bytes(text: str) -> int:
    """``sys.getsizeof(text)`` with its UTF-8 copy, whether CPython made it yet or not."""
    if text.isascii():
        return sys.getsizeof(text)  # the UTF-8 form is the text itself
    try:
        utf8 = len(text.encode()) + 1
    except UnicodeEncodeError:  # lone surrogates: there is no UTF-8 form to keep
        utf8 = 0
    return _COMPACT + _width(text) * (len(text) + 1) + utf8


def _width(text: str) -> int:
    """Bytes per character CPython stores this text with (1, 2 or 4)."""
    try:
        text.encode("latin-1")
        return 1
    except UnicodeEncodeError:
        pass
    return 2 if len(text.encode("utf-16-le", "surrogatepass")) == 2 * len(text) else 4


def event_bytes(event: Event) -> int:
    """The envelope, the body and the strings and bytes only this event holds.

    Cheap on purpose (a revived working set sizes every event of its tail): struct
    sizes are constants per type, so only the variable parts are measured, and
    ASCII text (nearly all of it) without a call to :func:`str_bytes`.
    """
    body = event.body
    kind = type(body)
    size = _EVENT + _BODY[kind]
    value = event.position
    if value > _SMALL_INT:
        size += _sizeof(value)
    value = event.tokens
    if value > _SMALL_INT:
        size += _sizeof(value)
    value = event.created_at
    if value > _SMALL_INT:
        size += _sizeof(value)
    hints = event.hints
    if hints is not None and len(hints) > 1:  # one-byte bytes objects are shared
        size += _sizeof(hints)
    if kind is UserMessage:
        text = body.text  # type: ignore[union-attr]
        return size + (_sizeof(text) if text.isascii() else str_bytes(text))
    if kind is ToolResult:
        assert isinstance(body, ToolResult)
        text = body.content
        size += _sizeof(text) if text.isascii() else str_bytes(text)
        size += str_bytes(body.call_id)
        if body.artifact is not None:
            size += str_bytes(body.artifact)
        return size
    if kind is AssistantMessage:
        assert isinstance(body, AssistantMessage)
        text = body.text
        size += _sizeof(text) if text.isascii() else str_bytes(text)
        if body.tool_calls:
            size += _sizeof(body.tool_calls)
            for call in body.tool_calls:
                size += _sizeof(call) + str_bytes(call.id) + str_bytes(call.name)
                size += _deep(call.arguments)
        return size
    if kind is Aborted:
        assert isinstance(body, Aborted)
        size += str_bytes(body.partial_text) + str_bytes(body.detail)
    return size


def checkpoint_bytes(checkpoint: Checkpoint | None) -> int:
    if checkpoint is None:
        return 0
    size = sys.getsizeof(checkpoint) + sys.getsizeof(checkpoint.markers)
    size += str_bytes(checkpoint.summary)
    for marker in checkpoint.markers:
        size += sys.getsizeof(marker) + sys.getsizeof(marker.topics)
        size += sum(str_bytes(t) for t in marker.topics)
    return size


def tail_bytes(tail: Sequence[Event]) -> int:
    """The events of a tail, walked from scratch."""
    return sum(map(event_bytes, tail))


def _deep(value: object) -> int:
    if isinstance(value, str):
        return str_bytes(value)
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        for k, v in value.items():
            size += _deep(k) + _deep(v)
    elif isinstance(value, list | tuple):
        for v in value:
            size += _deep(v)
    return size
