"""Checks of a store call's plain arguments, identical on every backend.

Every public store method checks its arguments here before it reaches a
database, so a bad argument is an :class:`~torpor.errors.InvalidInput` on
SQLite and PostgreSQL alike: never an ``OverflowError`` from binding ``2**70``,
a ``UnicodeEncodeError`` from a lone surrogate, or a driver error from NUL.
Ids follow :func:`torpor.text.check_id`, the one rule for what the log holds.

Bounds are the tighter of the two backends', so both accept the same calls:
positions stay below ``2**32`` (SQLite's search index packs them into 32 bits)
and turns, limits and call indexes fit PostgreSQL's 32-bit ``integer``.
"""

from __future__ import annotations

from collections.abc import Iterable

from torpor.errors import InvalidInput
from torpor.text import MAX_ID_LENGTH, check_id, check_text, is_storable, repair_text

__all__ = [
    "INT32_LIMIT",
    "MAX_ID_LENGTH",
    "POSITION_LIMIT",
    "check_after",
    "check_conversation_id",
    "check_count",
    "check_int",
    "check_key",
    "check_limit",
    "check_position",
    "check_turn",
    "search_query",
    "tool_names",
]

POSITION_LIMIT = 1 << 32
"""Positions are below this; as a bound (``before=``) it may be reached."""

INT32_LIMIT = 1 << 31


def check_int(value: object, what: str, low: int, high: int) -> int:
    """An int (a bool is not one) with ``low <= value < high``."""
    if type(value) is not int:
        raise InvalidInput(what, f"must be an int, got {type(value).__name__}")
    if not low <= value < high:
        raise InvalidInput(what, f"must be in {low}..{high - 1}, got {value}")
    return value


def check_conversation_id(conversation_id: object) -> str:
    return check_id(conversation_id, "conversation_id")


def check_key(key: object) -> str | None:
    """An idempotency key, or None."""
    return None if key is None else check_id(key, "key")


def check_position(value: object, what: str = "position") -> int:
    """A position argument of a read: 0 up to and including POSITION_LIMIT."""
    return check_int(value, what, 0, POSITION_LIMIT + 1)


def check_limit(value: object, what: str = "limit") -> int:
    """How many rows a read returns: at least one, at most what a 32-bit LIMIT holds."""
    return check_int(value, what, 1, INT32_LIMIT)


def check_turn(value: object, what: str = "turn") -> int:
    return check_int(value, what, 0, INT32_LIMIT)


def check_count(value: object, what: str) -> int:
    """A non-negative count or index stored in a 32-bit column (tokens, call_index)."""
    return check_int(value, what, 0, INT32_LIMIT)


def check_after(after: object) -> str | None:
    """A keyset cursor over conversation ids: None, or any text the log could hold."""
    return None if after is None else check_text(after, "after")


def tool_names(names: object) -> frozenset[str]:
    """Tool names a search leaves out: an iterable of str (not one str, whose letters
    would be taken for names)."""
    if isinstance(names, str | bytes) or not isinstance(names, Iterable):
        raise InvalidInput("exclude_tools", "must be a collection of tool names")
    out = frozenset(names)
    for name in out:
        if not isinstance(name, str):
            raise InvalidInput("exclude_tools", f"{name!r} is not a tool name")
    return out


def search_query(query: object) -> str:
    """A search query as the backends receive it.

    A query is free text, not a command, so text the log cannot hold is not an
    error: it can never be matched either. NUL and lone surrogates become
    spaces (word separators), the same on every backend: ``"a\\x00b"`` searches
    for ``a`` and ``b``.
    """
    if not isinstance(query, str):
        raise InvalidInput("query", f"must be a str, got {type(query).__name__}")
    if is_storable(query):
        return query
    return repair_text(query).replace("\ufffd", " ")
