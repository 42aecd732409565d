"""The anatomy of one model call (design source 001, Annex A.4) beyond section sizes.

What an engineer replaying the audit needs to reconstruct a call without the log
at hand: how many conversation events and markers were in context, what the turn
was about (a topic label, and whether it changed since the previous call), and a
turn id that sorts by time. Computed from what assembly already holds: the
rendered messages, the working set's checkpoint and the topic hints the store
extracted at append; nothing is scanned again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from torpor.compaction.background import BACKGROUND_MIN_EVENTS
from torpor.compaction.markers import hints_of, rank_topics
from torpor.events import Event, UserMessage
from torpor.llm.protocol import ContextMessage, SystemMessage
from torpor.store.protocol import Background, Checkpoint

__all__ = ["Anatomy", "anatomy", "events_in_context", "topic_label", "turn_id"]

LABEL_EVENTS = 64

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_PAIRS = tuple(a + b for a in _CROCKFORD for b in _CROCKFORD)


class Anatomy(msgspec.Struct, frozen=True, gc=False):
    turn_id: str
    events_in_context: int
    markers: int
    topic: str | None


def turn_id(started_ms: int, conversation_id: str, turn: int) -> str:
    """A ULID-shaped id (26 Crockford base32 characters) for one turn of one conversation.

    128 bits: the turn's start in epoch milliseconds (48), then the turn number (32),
    so ids sort as strings by time and, within one millisecond, by turn; then a hash
    of (conversation, turn) (48), so the id is the same on every call of the turn,
    and again after a revival, and differs between conversations.
    """
    ms = max(0, started_ms) & ((1 << 48) - 1)
    digest = hashlib.blake2b(f"{conversation_id}\0{turn}".encode(), digest_size=6).digest()
    v = (ms << 80) | ((turn & 0xFFFFFFFF) << 48) | int.from_bytes(digest, "big")
    # Two characters (10 bits) per lookup, unrolled: this runs on every model call.
    p = _PAIRS
    return "".join((
        p[v >> 120], p[(v >> 110) & 1023], p[(v >> 100) & 1023], p[(v >> 90) & 1023],
        p[(v >> 80) & 1023], p[(v >> 70) & 1023], p[(v >> 60) & 1023], p[(v >> 50) & 1023],
        p[(v >> 40) & 1023], p[(v >> 30) & 1023], p[(v >> 20) & 1023], p[(v >> 10) & 1023],
        p[v & 1023],
    ))


def events_in_context(messages: Sequence[ContextMessage]) -> int:
    """Conversation messages in a rendered context: all but the system prompt and handoff.

    Assembly puts those (and only those) system messages first, so counting the
    leading ones is enough: this runs before every call, and a tail of thousands
    of messages must not be walked again for one number.
    """
    lead = 0
    for message in messages:
        if not isinstance(message, SystemMessage):
            break
        lead += 1
    return len(messages) - lead


def _current_turn(tail: Sequence[Event]) -> Sequence[Event]:
    """The tail from its last user message on (all of it when there is none)."""
    for i in range(len(tail) - 1, -1, -1):
        if isinstance(tail[i].body, UserMessage):
            return tail[i:]
    return tail


def topic_label(tail: Sequence[Event], background: Background | None = None) -> str | None:
    """The best topic hint of the current turn's events (None when they have none).

    Falls back to the recent tail when the turn alone yields nothing, so a short
    follow-up ("and the other one?") keeps the topic of what it follows. At most
    :data:`LABEL_EVENTS` events are read either way: this runs before every call.
    Prose words are weighed against the conversation's ``background`` (its latest
    checkpoint's), as markers' are: a word the whole conversation uses is no label.
    """
    return _label(_current_turn(tail), tail, background)


def _label(
    current: Sequence[Event], tail: Sequence[Event], background: Background | None
) -> str | None:
    """:func:`topic_label` with the current turn found already."""
    untrusted = background is None or background.events < BACKGROUND_MIN_EVENTS
    for number in range(2):  # the turn's own events, then the recent tail
        span = current[:LABEL_EVENTS] if number == 0 else tail[-LABEL_EVENTS:]
        if len(span) == 1 and untrusted:
            # The first call of a turn: one event, ranked by itself, is its own hints'
            # order (best exact string first, else its first word): no ranking to run.
            flat = hints_of(span[0])
            if flat:
                label = flat[1]
                assert isinstance(label, str)
                return label
            continue
        ranked = rank_topics((hints_of(e) for e in span), 1, background, len(span))
        if ranked:
            return ranked[0]
    return None


def anatomy(
    conversation_id: str,
    turn: int,
    tail: Sequence[Event],
    checkpoint: Checkpoint | None,
    messages: Sequence[ContextMessage],
    now_ms: int,
) -> Anatomy:
    """The anatomy fields of a call rendered from ``tail`` (the working set's) and
    ``checkpoint``; the turn starts at its user message (``now_ms`` without one)."""
    current = _current_turn(tail)
    started = (
        current[0].created_at if current and isinstance(current[0].body, UserMessage) else now_ms
    )
    return Anatomy(
        turn_id=turn_id(started, conversation_id, turn),
        events_in_context=events_in_context(messages),
        markers=len(checkpoint.markers) if checkpoint is not None else 0,
        topic=_label(current, tail, checkpoint.background if checkpoint is not None else None),
    )
