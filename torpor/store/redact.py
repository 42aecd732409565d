"""What a redaction changes, the same on both backends (see ``EventStore.redact``).

A redaction replaces one event's body with a :class:`~torpor.events.Redacted` one, in
place: the one update of a log row, done by the store in one transaction and recorded
in ``deletions`` (``by="redact"``, the position, counts; never content). Positions stay
dense and the turn structure stays valid (:func:`~torpor.events.stand_in`).

Every derived copy of the text goes in the same transaction:

* the full-text entry (or its search-backlog row), the event's vectors, its artifact
  (the full text of a clipped body) and its stored topic hints;
* every checkpoint after the position (a fold that covered it: its summary, marker
  topics, background words, memory bundle may hold the text; a later fold's summary
  may build on an earlier one's), so the next fold rebuilds from the log, where the
  event is now redacted;
* the memory items of those folds (episodes and facts are named by their fold's
  checkpoint position: dropped, not rebuilt) and the ledger decisions naming them;
* a model call's stored topic label when it is a word of the text, and the
  conversation's default title when it was made from this message.

A model call's recipe holds positions, never text: it stays, and ``admin.rendered``
names the redacted positions instead of matching the hash.
"""

from __future__ import annotations

from torpor.errors import InvalidInput
from torpor.events import REDACTABLE, Body, Redacted, kind_of, redaction_of
from torpor.store.listing import default_title
from torpor.store.memory import LedgerEntry
from torpor.text import check_text

__all__ = [
    "MAX_REASON",
    "check_reason",
    "dropped_item",
    "redaction",
    "stale_entry",
    "stale_topic",
    "title_of",
]

MAX_REASON = 1000
"""Characters of a redaction's reason at most."""


def check_reason(reason: object) -> str:
    text = check_text(reason, "reason")
    if len(text) > MAX_REASON:
        raise InvalidInput("reason", f"must be at most {MAX_REASON} characters")
    return text


def redaction(body: Body, position: int, reason: str, at: int) -> Redacted | None:
    """The body that replaces ``body``; None when it is redacted already with this
    ``reason`` (a retry: nothing to do). A body redacted with another reason, or of a
    kind that holds no content (the turn structure: suspensions, answers' markers,
    parking, sub-agent links), is refused with InvalidInput."""
    if isinstance(body, Redacted):
        if body.reason == reason:
            return None
        raise InvalidInput(
            "position", f"{position} is redacted already (with another reason)"
        )
    kind = kind_of(body)
    if kind not in REDACTABLE:
        raise InvalidInput(
            "position", f"{position} is a {kind!r} event: it holds no content to redact"
        )
    return redaction_of(body, reason, at)


def dropped_item(item: str, position: int) -> bool:
    """Whether a memory item id (``episode:<fold>`` or ``<fold>.<ordinal>``) is of a fold
    after ``position`` (one that covered it)."""
    fold = item.removeprefix("episode:").split(".", 1)[0]
    return fold.isdigit() and int(fold) > position


def title_of(body: Body) -> str | None:
    """The default title ``body`` would have given its conversation (a user message)."""
    if kind_of(body) != "user":
        return None
    return default_title(getattr(body, "text", ""))


def stale_entry(entry: LedgerEntry, position: int) -> bool:
    """A ledger decision naming an item dropped with the folds after ``position``."""
    return dropped_item(entry.item, position) or any(
        dropped_item(item, position) for item in entry.superseded
    )


def stale_topic(topic: str | None, text: str) -> bool:
    """A model call's topic label taken from ``text`` (labels are words of the text)."""
    return bool(topic) and topic is not None and topic.casefold() in text.casefold()
