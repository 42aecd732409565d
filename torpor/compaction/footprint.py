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
    Redacted,
    Resolved,
    Spawned,
    Suspended,
    TaskCard,
    ToolCall,
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
        (Spawned, Spawned("", "", "")),
        (TaskCard, TaskCard()),
        (Redacted, Redacted("")),
    )
}
_SMALL_INT = 256  # CPython shares the ints up to here: they cost an event nothing
_sizeof = sys.getsizeof
# sys.getsizeof costs a method lookup (~0.1 µs): sizes that are arithmetic are computed.
_DIGIT, _DIGIT2 = 1 << 30, 1 << 60  # CPython ints hold 30-bit digits
_INT1, _INT2 = _sizeof(_DIGIT - 1), _sizeof(_DIGIT2 - 1)
_ASCII = _sizeof("")  # an ASCII str: this plus one byte a character
_BYTES = _sizeof(b"")  # bytes: this plus one byte a byte
_CALL = _sizeof(ToolCall("", ""))
_TUPLE, _SLOT = _sizeof(()), _sizeof((0,)) - _sizeof(())


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
    sizes are constants per type and ASCII text (nearly all of it) is sized by its
    length, so a typical event costs a few arithmetic operations.
    """
    body = event.body
    kind = type(body)
    size = _EVENT + _BODY[kind]
    for value in (event.position, event.tokens, event.created_at):
        if value > _SMALL_INT:  # an int of one or two 30-bit digits, or (rarely) more
            size += _INT1 if value < _DIGIT else _INT2 if value < _DIGIT2 else _sizeof(value)
    hints = event.hints
    if hints is not None and len(hints) > 1:  # one-byte bytes objects are shared
        size += _BYTES + len(hints)
    if kind is UserMessage:
        text = body.text  # type: ignore[union-attr]
        size += _ASCII + len(text) if text.isascii() else str_bytes(text)
        metadata = body.metadata  # type: ignore[union-attr]
        return size if metadata is None else size + _deep(metadata)
    if kind is ToolResult:
        assert isinstance(body, ToolResult)
        text = body.content
        size += _ASCII + len(text) if text.isascii() else str_bytes(text)
        size += _text(body.call_id)
        if body.artifact is not None:
            size += _text(body.artifact)
        return size
    if kind is AssistantMessage:
        assert isinstance(body, AssistantMessage)
        text = body.text
        size += _ASCII + len(text) if text.isascii() else str_bytes(text)
        calls = body.tool_calls
        if calls:
            size += _TUPLE + _SLOT * len(calls)
            for call in calls:
                size += _CALL + _text(call.id) + _text(call.name) + _deep(call.arguments)
        return size
    if kind is Aborted:
        assert isinstance(body, Aborted)
        size += _text(body.partial_text) + _text(body.detail)
    elif kind is TaskCard:
        assert isinstance(body, TaskCard)
        size += _text(body.goal) + _TUPLE * 3 + _SLOT * len(body.key_positions)
        for item in (*body.constraints, *body.open_loops):
            size += _SLOT + _text(item)
    return size


def _text(text: str) -> int:
    return _ASCII + len(text) if text.isascii() else str_bytes(text)


def checkpoint_bytes(checkpoint: Checkpoint | None) -> int:
    if checkpoint is None:
        return 0
    size = sys.getsizeof(checkpoint) + sys.getsizeof(checkpoint.markers)
    size += str_bytes(checkpoint.summary)
    for marker in checkpoint.markers:
        size += sys.getsizeof(marker) + sys.getsizeof(marker.topics)
        size += sum(str_bytes(t) for t in marker.topics)
    if checkpoint.task_card is not None:
        size += event_bytes(checkpoint.task_card)
    background = checkpoint.background
    if background is not None:  # its counts are small ints: cached objects, not counted
        size += sys.getsizeof(background) + sys.getsizeof(background.words)
        size += sys.getsizeof(background.counts) + sum(map(str_bytes, background.words))
    return size


def tail_bytes(tail: Sequence[Event]) -> int:
    """The events of a tail, walked from scratch."""
    return sum(map(event_bytes, tail))


def _deep(value: object) -> int:
    """A decoded JSON value (tool call arguments), ASCII strings sized by their length."""
    if type(value) is str:
        return _ASCII + len(value) if value.isascii() else str_bytes(value)
    size = _sizeof(value)
    if isinstance(value, dict):
        for k, v in value.items():
            size += _ASCII + len(k) if type(k) is str and k.isascii() else _deep(k)
            size += _ASCII + len(v) if type(v) is str and v.isascii() else _deep(v)
    elif isinstance(value, list | tuple):
        for v in value:
            size += _deep(v)
    elif isinstance(value, str):  # a str subclass
        size = str_bytes(value)
    return size
