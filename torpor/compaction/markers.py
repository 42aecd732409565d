"""Pointer markers: what a fold leaves in context instead of the folded turns.

A marker is not a summary. It names a span of the log (positions and times),
a few exact strings found in it (paths, hashes, identifiers, parameters:
the things a later query will want to match) and says how to get the span back.
Markers of adjacent folds merge like a binary counter, so after C folds there
are O(log C) of them and their total text stays small.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import TypeAlias

import msgspec

from torpor.events import AssistantMessage, Body, Event, ToolResult, searchable_text
from torpor.store.protocol import Checkpoint, Marker

__all__ = [
    "HANDOFF_HEADER",
    "HINTS_FORMAT",
    "Hints",
    "decode_hints",
    "encode_hints",
    "event_hints",
    "hints_of",
    "extract_topics",
    "format_marker",
    "handoff_text",
    "make_marker",
    "merge_markers",
    "rank_topics",
    "text_hints",
]

HANDOFF_HEADER = (
    "Earlier turns of this conversation were folded out of this context; "
    "the log still holds them word for word."
)

MAX_TOPIC_CHARS = 64
"""Longer candidates are not useful as hints (and cost too many tokens)."""

SCAN_CHARS = 2_048
"""Characters of one event scanned for hints: bounds the cost of one huge event."""

HINTS_PER_EVENT = 4
"""Candidates kept per event (the best by weight, then by order of appearance)."""

_EXTENSIONS = (
    "py|pyi|js|ts|tsx|jsx|rs|go|java|rb|c|h|cc|cpp|hpp|md|rst|txt|json|yaml|yml|toml|ini|"
    "cfg|conf|sql|sh|csv|html|css|lock|log|xml|proto"
)
# Tried only where a token starts; the first alternative that matches names the kind.
# The negative lookahead skips plain lowercase words (most of any text) in one scan,
# which makes extraction about three times faster than trying every alternative.
_HINT_RE = re.compile(
    rf"""(?<![\w/.=~\-])(?![a-z]+(?:[\s,;!?)]|[.:](?:\s|$)|$))(?:
      (?P<url>https?://[^\s<>"'`)\]]+)
    | (?P<path>[~./][\w.@+~/-]*/[\w.@+/-]*|[\w.-]+/[\w.@+-]+(?:/[\w.@+-]+)*
               |[\w-]+\.(?:{_EXTENSIONS})\b)
    | (?P<param>[A-Za-z_][\w.-]*=[^\s,;'"`)\]]+)
    | (?P<ident>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?|[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b
                |[a-z]+(?:[A-Z][a-z0-9]*)+\b|[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+\b)
    | (?P<hash>(?=[a-f]*[0-9])[0-9a-f]{{7,64}}\b)
    | (?P<unit>\d+(?:\.\d+)?\s?(?:ms|us|ns|s|sec|min|h|KB|MB|GB|TB|KiB|MiB|GiB|kB|B|%|px
               |tokens|rps|qps|Hz|MHz|GHz)(?!\w))
    | (?P<acro>[A-Z]{{2,}}[0-9]*\b)
    | (?<=[\w,;)][ ])(?P<cap>[A-Z][a-z]{{2,}}(?:\s[A-Z][a-z]{{2,}})*\b)
    | "(?P<dq>[^"\n]{{3,60}})"
    | `(?P<bq>[^`\n]{{2,60}})`
    )""",
    re.VERBOSE,
)

# Exact strings are worth more than capitalised words: they are what queries miss.
_WEIGHTS = {
    "url": 5,
    "path": 5,
    "hash": 5,
    "param": 5,
    "bq": 4,
    "unit": 3,
    "dq": 3,
    "ident": 3,
    "acro": 2,
    "cap": 1,
}
_STRIP = frozenset(("path", "param", "url", "unit"))
_TRAILING = ".,;:!?)]}'\""
_COMMON_ACRONYMS = frozenset(("OK", "AM", "PM", "TODO", "FYI", "ID", "IDS"))

Hints: TypeAlias = tuple[int | str, ...]
"""One event's topic candidates, flattened ``(weight, topic, weight, topic, ...)``.

Flat, because a working set keeps one per tail event and a tuple of pairs
would cost a tuple object per candidate.
"""


def text_hints(text: str, limit: int = HINTS_PER_EVENT) -> Hints:
    """The best ``limit`` topic candidates of one text, as flattened (weight, topic)."""
    if not text:
        return ()
    if len(text) > SCAN_CHARS:
        text = text[:SCAN_CHARS]
    found: dict[str, int] = {}
    for match in _HINT_RE.finditer(text):
        kind = match.lastgroup
        assert kind is not None
        topic = match.group(kind)
        if kind in _STRIP:
            topic = topic.rstrip(_TRAILING)
        elif kind == "acro" and topic in _COMMON_ACRONYMS:
            continue
        if not 2 <= len(topic) <= MAX_TOPIC_CHARS:
            continue
        weight = _WEIGHTS[kind]
        if found.get(topic, 0) < weight:
            found[topic] = weight
    if not found:
        return ()
    order = {topic: i for i, topic in enumerate(found)}
    best = sorted(found, key=lambda t: (-found[t], order[t]))[:limit]
    flat: list[int | str] = []
    for topic in best:
        flat.append(found[topic])
        flat.append(topic)
    return tuple(flat)


def _hint_text(body: Body) -> str:
    """The text worth mining: what was said, and the values tools were called with.

    Tool names and JSON keys repeat in every turn and say little; they are left out.
    """
    if isinstance(body, AssistantMessage) and body.tool_calls:
        values: list[str] = [body.text] if body.text else []
        for call in body.tool_calls:
            _string_values(call.arguments, values)
        return "\n".join(values)
    if isinstance(body, ToolResult):
        return body.content
    return searchable_text(body)


def _string_values(value: object, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _string_values(item, out)
    elif isinstance(value, list | tuple):
        for item in value:
            _string_values(item, out)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        out.append(str(value))


def event_hints(event: Event, limit: int = HINTS_PER_EVENT) -> Hints:
    """Topic candidates of one event."""
    return text_hints(_hint_text(event.body), limit)


HINTS_FORMAT = 1
"""First byte of stored hints (:func:`encode_hints`): bump it whenever extraction changes
(the pattern, the weights, :data:`SCAN_CHARS`, :data:`HINTS_PER_EVENT`), so hints stored by
an older version are extracted again instead of trusted."""

_FORMAT = bytes([HINTS_FORMAT])  # also what an event without candidates stores
_hints_encoder = msgspec.msgpack.Encoder()
_hints_decoder = msgspec.msgpack.Decoder(tuple[int | str, ...])


def encode_hints(body: Body) -> bytes:
    """An event's topic candidates as the store keeps them (its ``HintExtractor``).

    Extracted once, when the event is appended, so a fold reads them instead of
    scanning every folded event again: a revived agent folds as cheaply as a live
    one. The format byte first, then msgpack of the flattened candidates (nothing
    more when there are none: a one-byte ``bytes`` is a shared object).
    """
    flat = text_hints(_hint_text(body))
    if not flat:
        return _FORMAT
    return _FORMAT + _hints_encoder.encode(flat)


def decode_hints(stored: bytes | None) -> Hints | None:
    """Candidates from :func:`encode_hints`, or None when there are none of this format."""
    if stored is None or stored[:1] != _FORMAT:
        return None
    if len(stored) == 1:
        return ()
    try:
        return _hints_decoder.decode(memoryview(stored)[1:])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # not ours after all: extract again


def hints_of(event: Event) -> Hints:
    """An event's topic candidates: as stored at append, else extracted now (same result)."""
    stored = event.hints
    if stored == _FORMAT:  # the common case, settled without a call: nothing worth a hint
        return ()
    flat = decode_hints(stored)
    return event_hints(event) if flat is None else flat


def rank_topics(hints: Iterable[Hints], limit: int = 8) -> tuple[str, ...]:
    """Up to ``limit`` topics of a span, best first: weight x events it appears in.

    Ties go to the topic seen first, so the result depends only on the span.
    """
    scores: dict[str, int] = {}
    for flat in hints:
        if not flat:  # most events: a fold over thousands of them must not pay per event
            continue
        for i in range(0, len(flat), 2):
            topic = flat[i + 1]
            assert isinstance(topic, str)
            weight = flat[i]
            assert isinstance(weight, int)
            scores[topic] = scores.get(topic, 0) + weight
    order = {topic: i for i, topic in enumerate(scores)}
    ranked = sorted(scores, key=lambda t: (-scores[t], order[t]))
    return tuple(ranked[:limit])


def extract_topics(events: Sequence[Event], limit: int = 8) -> tuple[str, ...]:
    """Up to ``limit`` exact strings from a span of events, best first; deterministic.

    Kinds, from most to least telling: URLs, paths, hashes, ``key=value``
    parameters, backquoted code, identifiers, numbers with units, quoted
    strings, acronyms, capitalised terms (mid-sentence only).
    """
    return rank_topics((event_hints(e) for e in events), limit)


def make_marker(
    events: Sequence[Event], max_topics: int = 8, hints: Sequence[Hints] | None = None
) -> Marker:
    """A level-0 marker for one folded span (``events`` in log order, non-empty).

    ``hints``: the events' candidates if already extracted (one per event).
    """
    if not events:
        raise ValueError("a marker needs at least one event")
    head, tail = events[0], events[-1]
    topics = (
        rank_topics(hints, max_topics) if hints is not None else extract_topics(events, max_topics)
    )
    return Marker(
        start=head.position,
        end=tail.position,
        start_ms=head.created_at,
        end_ms=max(tail.created_at, head.created_at),
        topics=topics,
        level=0,
    )


def _interleave(a: Sequence[str], b: Sequence[str], limit: int) -> tuple[str, ...]:
    """Topics of two markers, alternating (older first) without duplicates, trimmed."""
    out: list[str] = []
    seen: set[str] = set()
    for i in range(max(len(a), len(b))):
        for source in (a, b):
            if i < len(source) and source[i] not in seen:
                seen.add(source[i])
                out.append(source[i])
                if len(out) == limit:
                    return tuple(out)
    return tuple(out)


def _merge_two(older: Marker, newer: Marker, max_topics: int) -> Marker:
    return Marker(
        start=older.start,
        end=newer.end,
        start_ms=min(older.start_ms, newer.start_ms),
        end_ms=max(older.end_ms, newer.end_ms),
        topics=_interleave(older.topics, newer.topics, max_topics),
        level=max(older.level, newer.level) + 1,
    )


def merge_markers(
    existing: tuple[Marker, ...], new: Marker, cap: int = 8, *, max_topics: int = 8
) -> tuple[Marker, ...]:
    """Add ``new`` after ``existing`` and merge hierarchically.

    Two adjacent markers of equal level become one of level + 1 (a binary
    counter: C folds leave at most log2(C) + 1 markers); beyond ``cap`` the two
    oldest merge whatever their level. Only adjacent markers merge by level, so
    with contiguous folds a merged range never claims positions it did not cover.
    """
    if cap < 1:
        raise ValueError("cap must be >= 1")
    out = [*existing, new]
    while len(out) >= 2 and out[-1].level == out[-2].level and out[-2].end + 1 == out[-1].start:
        out[-2:] = [_merge_two(out[-2], out[-1], max_topics)]
    while len(out) > cap:
        out[0:2] = [_merge_two(out[0], out[1], max_topics)]
    return tuple(out)


def _clock(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000.0, tz=UTC)


def format_marker(marker: Marker) -> str:
    """One line a model can act on: which events, when, about what, and how to get them back."""
    if marker.start == marker.end:
        span = f"event {marker.start}"
    else:
        span = f"events {marker.start}\u2013{marker.end}"
    begin, end = _clock(marker.start_ms), _clock(marker.end_ms)
    if begin.date() == end.date():
        when = f"{begin:%Y-%m-%d %H:%M}\u2013{end:%H:%M} UTC"
    else:
        when = f"{begin:%Y-%m-%d %H:%M} \u2013 {end:%Y-%m-%d %H:%M} UTC"
    topics = f"; topics: {', '.join(marker.topics)}" if marker.topics else ""
    return f"[{span} ({when}) folded{topics}; use recall(query) to retrieve]"


def handoff_text(checkpoint: Checkpoint) -> str:
    """The system message a checkpoint renders to ("" when it carries nothing)."""
    if not checkpoint.markers and not checkpoint.summary:
        return ""
    lines = [HANDOFF_HEADER]
    lines.extend(format_marker(m) for m in checkpoint.markers)
    if checkpoint.summary:
        lines.append("Summary of the folded turns:")
        lines.append(checkpoint.summary)
    return "\n".join(lines)
