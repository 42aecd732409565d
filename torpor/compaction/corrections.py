"""Prose corrections: a later event that supersedes an earlier one in plain language.

``NAME = value`` corrections are found by key (:func:`~torpor.compaction.push.fact_keys`).
A person corrects in prose instead: "The payments service is going to ap-northeast-1.",
then "Scratch that, use eu-north-1.", which shares no word with what a later question
asks ("deploying payments"), so search alone never finds it. Here an event corrects an
earlier one when, within :data:`WINDOW_EVENTS` events and :data:`WINDOW_TURNS` turns
after it:

* it holds a correction marker (:data:`MARKERS`: "scratch that", "actually",
  "instead", "no longer", "changed to", "make that", "I meant", …), and
* it is about the same subject: it names a word of the earlier event's subject and
  gives a value of the same shape (``eu-north-1`` for ``ap-northeast-1``, a number for
  a number, a name for a name), or it names no subject of its own (it points back:
  "scratch that") and gives such a value, or it says the earlier fact "no longer"
  holds and names a word of its subject.

The nearest such event is the correction; a correction of that correction is followed
(a chain of :data:`MAX_CHAIN`). Recall and push show a corrected event together with
its correction, never one without the other.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Sequence

from torpor.compaction.markers import common_word
from torpor.events import Event, ToolResult, presented, searchable_text
from torpor.store.protocol import EventStore

__all__ = ["MARKERS", "WINDOW_EVENTS", "WINDOW_TURNS", "corrected_by", "corrections", "corrects"]

WINDOW_EVENTS = 12
"""How many events after a fact its correction may come (a few turns of conversation)."""
WINDOW_TURNS = 3
"""How many turns after a fact's turn its correction may come."""
MAX_CHAIN = 3
"""Corrections of corrections followed, at most."""

MARKERS = re.compile(
    r"\b(?:scratch that|actually|instead|no longer|changed? (?:it |that |this )?to|"
    r"make (?:it|that)|i meant|correction|on second thought|rather than|no wait|"
    r"not any ?more|switch(?:ed)? (?:it |that )?to)\b",
    re.IGNORECASE,
)
"""Words with which a person says an earlier statement no longer holds."""

_MARKER_TEXT = """
    scratch actually instead longer changed change correction meant second thought
    rather wait anymore switch switched make use going
"""
_MARKER_WORDS = frozenset(_MARKER_TEXT.split())
_VALUE = re.compile(
    r"(?<![\w\-./])(?:[A-Za-z0-9]+(?:[-_./:][A-Za-z0-9]+)+|\d[\d,.]*\d|\d)(?![\w\-/])"
)
_NAME = re.compile(r"(?<=[a-z,;:] )[A-Z][a-z]+(?: [A-Z][a-z]+)*")
_WORD = re.compile(r"[A-Za-z]+")
_MAX_POINTING_WORDS = 24  # a correction that points back ("scratch that, …") is short


def _shape(value: str) -> str:
    """``ap-northeast-1`` -> ``a-a-9``: letters, digits and separators, runs collapsed."""
    out = re.sub(r"[A-Za-z]+", "a", value)
    return re.sub(r"\d[\d,.]*", "9", out)


def _values(text: str) -> set[str]:
    shapes = {_shape(v) for v in _VALUE.findall(text) if any(c.isdigit() for c in v) or
              any(c in "-_./:" for c in v)}
    if _NAME.search(text):
        shapes.add("Name")
    return shapes


def _subject(text: str) -> set[str]:
    """The words a statement is about: salient words, no markers, no values, no names."""
    rest = _NAME.sub(" ", _VALUE.sub(" ", text))
    return {
        w for w in (m.lower() for m in _WORD.findall(rest))
        if len(w) > 3 and not common_word(w) and w not in _MARKER_WORDS
    }


def _text(event: Event) -> str:
    return " ".join(searchable_text(event.body).split())


def corrects(later: str, earlier: str) -> bool:
    """Whether the text ``later`` corrects ``earlier`` in prose (see the module doc)."""
    marker = MARKERS.search(later)
    if marker is None:
        return False
    old, new = _subject(earlier), _subject(later)
    same_value = bool(_values(later) & _values(earlier))
    if new & old:
        return same_value or "longer" in marker.group().lower()
    own = new - old
    return same_value and not own and len(later.split()) <= _MAX_POINTING_WORDS


def _evidence(event: Event) -> bool:
    """Whether an event can state or correct a fact (tool results of the echo tools and
    events without text cannot)."""
    body = event.body
    if isinstance(body, ToolResult) and body.tool in ("recall", "expand"):
        return False
    return bool(_text(event))


def corrected_by(event: Event, after: Sequence[Event]) -> Event | None:
    """The nearest event of ``after`` (ascending) that corrects ``event``, within the window."""
    text = _text(event)
    for later in after:
        if later.position <= event.position:
            continue
        if (later.position - event.position > WINDOW_EVENTS
                or later.turn - event.turn > WINDOW_TURNS):
            break
        if _evidence(later) and corrects(_text(later), text):
            return later
    return None


async def corrections(
    store: EventStore, conversation_id: str, events: Iterable[Event]
) -> dict[int, list[Event]]:
    """For each of ``events`` that a later event corrects: its corrections, oldest first
    (the nearest correction, then what corrects that, up to :data:`MAX_CHAIN`)."""
    wanted = sorted({e.position: e for e in events if _evidence(e)}.values(),
                    key=lambda e: e.position)
    if not wanted:
        return {}
    spans = _spans([e.position for e in wanted])
    reads = await asyncio.gather(*(store.read_range(conversation_id, lo, hi) for lo, hi in spans))
    window = {e.position: presented(e) for read in reads for e in read}
    ordered = [window[p] for p in sorted(window)]
    out: dict[int, list[Event]] = {}
    for event in wanted:
        chain: list[Event] = []
        current = event
        while len(chain) < MAX_CHAIN:
            after = [e for e in ordered if e.position > current.position]
            found = corrected_by(current, after)
            if found is None:
                break
            chain.append(found)
            current = found
        if chain:
            out[event.position] = chain
    return out


def _spans(positions: Sequence[int]) -> list[tuple[int, int]]:
    """The windows after ``positions`` (each covers a chain), merged where they overlap."""
    reach = WINDOW_EVENTS * MAX_CHAIN
    spans: list[tuple[int, int]] = []
    for position in positions:
        lo, hi = position + 1, position + reach
        if spans and lo <= spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
        else:
            spans.append((lo, hi))
    return spans
