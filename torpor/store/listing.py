"""The conversations index as both backends page it, and the records of a deletion.

The index is the ``conversations`` row itself (created at the first write, moved
by every append in the transaction that moves the head): ``created_at``,
``updated_at`` (the last activity: an append or a fold), the head (so the event
count), and since schema 8 a ``title`` and ``metadata`` (JSON). An index on
``(updated_at, key)`` pages it newest activity first without reading the log; a
``prefix`` is a range of the unique index of ids, its rows then sorted (a
user's prefix holds that user's conversations, a few, whatever the total).

The title defaults to the first user message, clipped (:func:`default_title`),
set by the append that logs it unless the host set one first.

A deletion (``EventStore.delete``) is the one place rows leave the store; each
one is recorded as a :class:`Deletion` in the ``deletions`` table: which
conversations, how many rows per table, when, and by what (``"delete"``,
``"redact"``, ``"retention"``), never any content.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from torpor.errors import InvalidInput
from torpor.events import UserMessage
from torpor.text import check_text

__all__ = [
    "DELETION_CAUSES",
    "TITLE_CHARS",
    "ConversationPage",
    "Cursor",
    "Deletion",
    "DeletionCause",
    "check_cause",
    "check_metadata",
    "check_title",
    "decode_cursor",
    "decode_metadata",
    "default_title",
    "encode_cursor",
    "encode_metadata",
    "first_title",
    "prefix_range",
]

TITLE_CHARS = 80
"""A default title's length at most (the first user message, clipped)."""

_TITLE_LIMIT = 1000  # a title the host sets
_METADATA_LIMIT = 64 * 1024  # bytes of JSON

DeletionCause = Literal["delete", "redact", "retention"]
DELETION_CAUSES: frozenset[str] = frozenset({"delete", "redact", "retention"})

Cursor = tuple[int, int]
"""(last activity, conversation key) of the last row of a page: the next starts below it."""


class Deletion(msgspec.Struct, frozen=True, gc=False):
    """One audited removal: ids and counts, never content.

    ``conversations``: the conversation and the sub-agent conversations deleted with
    it; ``rows``: rows removed per table (the full-text index counted in entries);
    ``at``: epoch ms; ``by``: what asked for it. ``id``: its row in ``deletions``.
    """

    id: int
    conversations: tuple[str, ...]
    rows: dict[str, int]
    at: int
    by: str


class ConversationPage(msgspec.Struct, frozen=True, gc=False):
    """A page of :class:`~torpor.store.protocol.ConversationInfo`, newest activity first;
    ``next``: the cursor of the following page (pass it as ``after``), None at the end."""

    items: tuple[Any, ...]  # ConversationInfo (protocol imports this module)
    next: str | None = None

    def __iter__(self) -> Any:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def encode_cursor(updated_at: int, key: int) -> str:
    return f"{updated_at}.{key}"


def decode_cursor(after: object) -> Cursor | None:
    """A cursor a page returned (opaque to callers), or None; InvalidInput otherwise."""
    if after is None:
        return None
    if not isinstance(after, str):
        kind = type(after).__name__
        raise InvalidInput("after", f"must be a cursor from a page (str), got {kind}")
    when, dot, key = after.partition(".")
    if not (dot and when.isdigit() and key.isdigit() and len(when) < 19 and len(key) < 19):
        raise InvalidInput("after", f"{after!r} is not a cursor a page returned")
    return int(when), int(key)


def prefix_range(prefix: object) -> tuple[str, str | None] | None:
    """The ids starting with ``prefix`` as a range ``[low, high)`` in code point order,
    which is both backends' id order (UTF-8 bytes); ``high`` None: no upper bound."""
    if prefix is None:
        return None
    text = check_text(prefix, "prefix")
    if not text:
        return None
    chars = list(text)
    while chars:
        last = ord(chars[-1]) + 1
        if 0xD800 <= last <= 0xDFFF:
            last = 0xE000  # surrogates are never stored: skip them
        if last <= 0x10FFFF:
            chars[-1] = chr(last)
            return text, "".join(chars)
        chars.pop()
    return text, None


def default_title(text: str) -> str:
    """A user message as a title: whitespace collapsed, clipped to :data:`TITLE_CHARS`."""
    flat = " ".join(text.split())
    if len(flat) <= TITLE_CHARS:
        return flat
    return flat[: TITLE_CHARS - 1].rstrip() + "\u2026"


def first_title(bodies: Any) -> str | None:
    """The default title an append brings: of its first user message, if any."""
    for body in bodies:
        if type(body) is UserMessage:
            return default_title(body.text)
    return None



def check_title(title: object) -> str:
    text = check_text(title, "title")
    if len(text) > _TITLE_LIMIT:
        raise InvalidInput("title", f"must be at most {_TITLE_LIMIT} characters")
    return text


def check_metadata(metadata: object) -> str:
    """``metadata`` (a mapping of str keys to JSON values) as the JSON text stored."""
    if not isinstance(metadata, Mapping):
        raise InvalidInput("metadata", f"must be a mapping, got {type(metadata).__name__}")
    for key in metadata:
        if not isinstance(key, str):
            raise InvalidInput("metadata", f"keys must be str, got {key!r}")
    try:
        encoded = msgspec.json.encode(dict(metadata)).decode()
    except (TypeError, msgspec.EncodeError, UnicodeDecodeError) as exc:
        raise InvalidInput("metadata", f"must be JSON-encodable: {exc}") from exc
    check_text(encoded, "metadata")
    if len(encoded.encode()) > _METADATA_LIMIT:
        raise InvalidInput("metadata", f"must be at most {_METADATA_LIMIT} bytes as JSON")
    return encoded


def encode_metadata(metadata: Mapping[str, Any]) -> str:
    return msgspec.json.encode(dict(metadata)).decode()


def decode_metadata(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def check_cause(by: object) -> str:
    if by not in DELETION_CAUSES:
        raise InvalidInput("by", f"must be one of {sorted(DELETION_CAUSES)}, got {by!r}")
    return str(by)
