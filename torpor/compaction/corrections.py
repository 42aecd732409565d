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

_CUES = ("scratch", "actually", "instead", "longer", "chang", "make", "meant", "correction",
         "second", "rather", "wait", "more", "switch")
"""A word of every marker: texts holding none are not searched with :data:`MARKERS`."""
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


def _text(event: Event) -> str:
    return " ".join(searchable_text(event.body).split())


class _Window:
    """Events read around the facts, their texts computed once."""

    def __init__(self, events: Iterable[Event]) -> None:
        self.events = {e.position: presented(e) for e in events}
        self._texts: dict[int, str] = {}
        self._marked: dict[int, bool] = {}

    def marked(self, position: int) -> bool:
        """Whether the event holds a correction marker (a substring test first: cheap)."""
        marked = self._marked.get(position)
        if marked is None:
            text = self.text(position)
            low = text.lower()
            marked = any(cue in low for cue in _CUES) and MARKERS.search(text) is not None
            self._marked[position] = marked
        return marked

    def text(self, position: int) -> str:
        text = self._texts.get(position)
        if text is None:
            text = self._texts[position] = _text(self.events[position])
        return text

    def corrected_by(self, event: Event) -> Event | None:
        """The nearest event after ``event``, within the window, that corrects it."""
        for position in range(event.position + 1, event.position + WINDOW_EVENTS + 1):
            later = self.events.get(position)
            if later is None or later.turn - event.turn > WINDOW_TURNS:
                return None
            if (self.marked(position) and _evidence(later)
                    and corrects(self.text(position), self.text(event.position))):
                return later
        return None


def corrected_by(event: Event, after: Sequence[Event]) -> Event | None:
    """The nearest event of ``after`` that corrects ``event``, within the window."""
    return _Window([event, *after]).corrected_by(event)


async def corrections(
    store: EventStore, conversation_id: str, positions: Iterable[int]
) -> dict[int, list[Event]]:
    """For each event at ``positions`` that a later event corrects: its corrections, oldest
    first (the nearest correction, then what corrects that, up to :data:`MAX_CHAIN`).
    Reads each fact with the window after it, overlapping windows merged."""
    wanted = sorted(set(positions))
    if not wanted:
        return {}
    window = _Window(await _read(store, conversation_id, _spans(wanted)))
    out: dict[int, list[Event]] = {}
    for position in wanted:
        current = window.events.get(position)
        if current is None or not _evidence(current):
            continue
        chain: list[Event] = []
        while len(chain) < MAX_CHAIN:
            if chain and current.position + WINDOW_EVENTS not in window.events:  # read on
                span = (current.position + 1, current.position + WINDOW_EVENTS)
                window.events.update(
                    (e.position, presented(e)) for e in await _read(store, conversation_id, [span])
                )
            found = window.corrected_by(current)
            if found is None:
                break
            chain.append(found)
            current = found
        if chain:
            out[position] = chain
    return out


async def _read(
    store: EventStore, conversation_id: str, spans: Sequence[tuple[int, int]]
) -> list[Event]:
    reads = await asyncio.gather(
        *(store.read_range(conversation_id, lo, hi) for lo, hi in spans)
    )
    return [event for read in reads for event in read]


def _spans(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Each fact and the window after it (ascending), merged where they overlap."""
    spans: list[tuple[int, int]] = []
    for position in positions:
        lo, hi = position, position + WINDOW_EVENTS
        if spans and lo <= spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
        else:
            spans.append((lo, hi))
    return spans
