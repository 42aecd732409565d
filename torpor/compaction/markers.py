"""Pointer markers: what a fold leaves in context instead of the folded turns.

A marker is not a summary. It names a span of the log (positions and times),
a few exact strings found in it (paths, hashes, identifiers, parameters:
the things a later query will want to match), a few salient words when the span
is prose (so a chat about deployments is not a marker without topics) and says
how to get the span back.
Markers of adjacent folds merge like a binary counter, so after C folds there
are O(log C) of them and their total text stays small.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import TypeAlias

import msgspec

from torpor.compaction.background import salience
from torpor.events import (
    AssistantMessage,
    Body,
    Event,
    ToolResult,
    UserMessage,
    searchable_text,
)
from torpor.store.protocol import Background, Checkpoint, Marker

__all__ = [
    "HANDOFF_HEADER",
    "HINTS_FORMAT",
    "Hints",
    "common_word",
    "decode_hints",
    "encode_hints",
    "event_hints",
    "hints_of",
    "extract_topics",
    "format_marker",
    "handoff_text",
    "make_marker",
    "merge_markers",
    "prose_read",
    "rank_topics",
    "span_hints",
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
"""Exact-string candidates kept per event (the best by weight, then by order of appearance)."""

WORDS_PER_EVENT = 3
"""Prose candidates kept per event besides them (the most repeated, then the first seen)."""

PROSE_WEIGHT = 1
"""The weight of a prose word, and only of one: how stored hints tell words from exact strings."""

MIN_WORD_CHARS = 4

# The background a word must stand out from: the commonest English words of four letters
# or more, and chat filler. What is left of prose is what it is about.
_COMMON_TEXT = """
    able about above across actually after again against ago all almost along already also
    although always among another any anyone anything anyway around away back based because
    been before being below best better between both bring came cannot case come comes
    could date days does doing done down during each either else enough even ever every
    everything example fact feel find fine first five following four from full further gave
    gets getting give given gives goes going gone good great had has have having hello help
    here hers herself high himself hope however idea into isnt itself just keep kind know
    known last later least less lets like likely line little long look looks looking made
    make makes making many maybe mean means might mine more most much must myself need
    needs never next nice nothing now okay once one ones only onto other others ours
    ourselves over part please point possible pretty probably quite rather really right
    said same says second see seems seen several shall should show since some someone
    something soon sorry still such sure take taken takes tell tells than thank thanks that
    thats their theirs them themselves then there these they thing things think this those
    though three through thus time times today together told too took toward tried tries
    true trying under unless until upon used uses using very want wants warm well went
    were what whatever when where whether which while whole whom whose will with within
    without wont work works would wrong year years yes yet your yours yourself yourselves
"""
_COMMON_WORDS = frozenset(_COMMON_TEXT.split())
_NO_WORDS: frozenset[str] = frozenset()


def common_word(word: str) -> bool:
    """Whether ``word`` is part of the background prose stands out from (common English)."""
    return word.lower() in _COMMON_WORDS

_PROSE_RE = re.compile(r"(?<![\w/.@#$%&=~\-])[A-Za-z][a-z]{3,}(?![\w/@#$%&=~\-]|\.\w)")

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
    "cap": 2,
}
assert min(_WEIGHTS.values()) > PROSE_WEIGHT  # the weight alone tells a word from the rest
_STRIP = frozenset(("path", "param", "url", "unit"))
_TRAILING = ".,;:!?)]}'\""
_COMMON_ACRONYMS = frozenset(("OK", "AM", "PM", "TODO", "FYI", "ID", "IDS"))

Hints: TypeAlias = tuple[int | str, ...]
"""One event's topic candidates, flattened ``(weight, topic, weight, topic, ...)``.

Flat, because a working set keeps one per tail event and a tuple of pairs
would cost a tuple object per candidate.
"""


def _prose_words(text: str, taken: dict[str, int], limit: int) -> list[str]:
    """The text's salient words, lowercased: not common English, not already a candidate;
    the most repeated first, then by first appearance."""
    counts: dict[str, int] = {}
    seen = {topic.lower() for topic in taken} if taken else _NO_WORDS
    common = _COMMON_WORDS
    for word in _PROSE_RE.findall(text):  # the pattern has no groups: whole matches
        word = word.lower()
        if word in common or word in seen:
            continue
        counts[word] = counts.get(word, 0) + 1
    return _most_repeated(counts, limit)


def _most_repeated(counts: dict[str, int], limit: int) -> list[str]:
    if len(counts) < 2 or len(counts) == sum(counts.values()):  # no repeats: first seen first
        return list(counts)[:limit]
    # A stable sort keeps equal counts in first-appearance order, reversed or not.
    return sorted(counts, key=counts.__getitem__, reverse=True)[:limit]


_PLAIN = re.compile(
    r"[a-z \n,;!?']*+"
    r"(?:(?:[.:](?=[ \n]|\Z)|(?<![A-Za-z])(?<![A-Za-z,;] )[A-Z])[a-z \n,;!?']*+)*+\Z"
)
"""Plain prose (most chat): ASCII letters, spaces, newlines and ``,;!?'``; ``.`` or ``:``
only before a space, a newline or the end; a capital only where a word begins, and not
after a word, ``,`` or ``;`` and a space (where :data:`_HINT_RE` takes capitalised terms).
:data:`_HINT_RE` matches nothing in it: its lookbehind refuses every letter but a word's
first, its lookahead skips most lowercase words, and of its alternatives (a URL needs
``://``, a path ``/`` or ``.`` before a letter, a parameter ``=``, an identifier ``.`` or
``_`` or a capital inside a word, a hash or a unit a digit, an acronym two capitals, a
capitalised term the place excluded, a quoted string ``"`` or a backquote) none begins
there. Its prose words (:data:`_PROSE_RE`) are its runs of four letters or more, whose
capital can only be the first: :data:`_RUNS` of the lowercased text.
"""
_RUNS = re.compile(r"[a-z]{4,}")


def _plain_prose(text: str, words: int) -> list[int | str]:
    """The flattened prose words of a text :data:`_PLAIN` matches (it has no exact strings)."""
    if words <= 0:
        return []
    if text.isalpha():  # one word, a run of letters already: no scan
        word = text.lower()
        if len(word) < 4 or word in _COMMON_WORDS:  # _RUNS: four letters or more
            return []
        return [PROSE_WEIGHT, word]
    text = text.lower()
    runs = _RUNS.findall(text)
    if not _COMMON_WORDS.isdisjoint(runs):
        runs = [word for word in runs if word not in _COMMON_WORDS]
    if len(runs) > 1 and len(set(runs)) < len(runs):  # repeats: the most repeated first
        counts: dict[str, int] = {}
        for word in runs:
            counts[word] = counts.get(word, 0) + 1
        runs = _most_repeated(counts, words)
    prose: list[int | str] = []
    for word in runs[:words]:
        prose.append(PROSE_WEIGHT)
        prose.append(word)
    return prose


def _candidates(text: str, limit: int, words: int) -> tuple[list[int | str], list[int | str]]:
    """:func:`text_hints` in its two parts: the flattened exact strings, then the prose words.

    Kept apart so :func:`encode_hints` stores each part without splitting them again.
    Plain lowercase prose (:data:`_PLAIN`) has no exact strings and skips the scan for
    them; :func:`_scanned` is the general path, and gives the same for it.
    """
    if len(text) > SCAN_CHARS:
        text = text[:SCAN_CHARS]
    if _PLAIN.match(text) is None:
        return _scanned(text, limit, words)
    return [], _plain_prose(text, words)


def _scanned(text: str, limit: int, words: int) -> tuple[list[int | str], list[int | str]]:
    """:func:`_candidates` of any text (at most :data:`SCAN_CHARS` characters)."""
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
    exact: list[int | str] = []
    if found:
        # A stable sort keeps equal weights in first-appearance order, reversed or not.
        for topic in sorted(found, key=found.__getitem__, reverse=True)[:limit]:
            exact.append(found[topic])
            exact.append(topic)
    prose: list[int | str] = []
    if words > 0:
        for word in _prose_words(text, found, words):
            prose.append(PROSE_WEIGHT)
            prose.append(word)
    return exact, prose


def text_hints(
    text: str, limit: int = HINTS_PER_EVENT, words: int = WORDS_PER_EVENT
) -> Hints:
    """The best ``limit`` exact-string candidates of one text, then up to ``words`` prose
    words (weight :data:`PROSE_WEIGHT`), as flattened (weight, topic)."""
    if not text:
        return ()
    exact, prose = _candidates(text, limit, words)
    return tuple(exact + prose) if prose else tuple(exact)


def _hint_text(body: Body) -> str:
    """The text worth mining: what was said, and the values tools were called with.

    Tool names and JSON keys repeat in every turn and say little; they are left out.
    """
    if type(body) is UserMessage:  # the commonest bodies first, by type: searchable_text's
        return body.text
    if type(body) is AssistantMessage and not body.tool_calls:
        return body.text
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


HINTS_FORMAT = 2
"""First byte of stored hints (:func:`encode_hints`): bump it whenever extraction changes
(the pattern, the weights, :data:`SCAN_CHARS`, :data:`HINTS_PER_EVENT`, the prose words), so
hints stored by an older version are extracted again instead of trusted.
1: exact strings only; 2: prose words too (weight :data:`PROSE_WEIGHT`)."""

_FORMAT = bytes([HINTS_FORMAT])  # also what an event without candidates stores
_NO_EXACT = _FORMAT + bytes(2)  # the prefix of stored hints with prose words only
_hints_encoder = msgspec.msgpack.Encoder()
_hints_decoder = msgspec.msgpack.Decoder(tuple[int | str, ...])

PROSE_SAMPLE = 256
"""Most events of a folded span whose prose words the fold reads (evenly spread): the
span's salient words show in any such sample, and a fold over 10,000 events of chat
must cost what it did before prose was mined (exact strings are read from every event)."""


def _split(flat: Hints) -> int:
    """Where the prose words of a flattened candidate list begin (they come last)."""
    for i in range(0, len(flat), 2):
        if flat[i] == PROSE_WEIGHT:
            return i
    return len(flat)


def encode_hints(body: Body) -> bytes:
    """An event's topic candidates as the store keeps them (its ``HintExtractor``).

    Extracted once, when the event is appended, so a fold reads them instead of
    scanning every folded event again: a revived agent folds as cheaply as a live
    one. The format byte first (nothing more when there are no candidates: a
    one-byte ``bytes`` is a shared object); then the byte length of the exact
    strings' section (2 bytes, big-endian), msgpack of the flattened exact strings
    (absent when there are none) and msgpack of the flattened prose words (absent
    when there are none). Two sections, so a fold reads the exact strings of every
    event without decoding the words of each.
    """
    text = _hint_text(body)
    if not text:
        return _FORMAT
    if len(text) > SCAN_CHARS:
        text = text[:SCAN_CHARS]
    if _PLAIN.match(text) is not None:  # _candidates' fast path, without its lists
        prose = _plain_prose(text, WORDS_PER_EVENT)
        return _NO_EXACT + _hints_encoder.encode(prose) if prose else _FORMAT
    exact, prose = _scanned(text, HINTS_PER_EVENT, WORDS_PER_EVENT)
    if not exact:
        return _NO_EXACT + _hints_encoder.encode(prose) if prose else _FORMAT
    head = _hints_encoder.encode(exact)
    tail = _hints_encoder.encode(prose) if prose else b""
    return _FORMAT + len(head).to_bytes(2, "big") + head + tail


def _decode(stored: bytes, exact: bool, prose: bool) -> Hints | None:
    """One or both sections of stored hints of this format; None when they do not decode."""
    if len(stored) == 1:
        return ()
    if len(stored) < 3:
        return None
    size = int.from_bytes(stored[1:3], "big")
    view = memoryview(stored)
    try:
        head = _hints_decoder.decode(view[3 : 3 + size]) if exact and size else ()
        tail = _hints_decoder.decode(view[3 + size :]) if prose and len(stored) > 3 + size else ()
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # not ours after all: extract again
    if 3 + size > len(stored):
        return None
    return head + tail if head and tail else head or tail


def decode_hints(stored: bytes | None) -> Hints | None:
    """Candidates from :func:`encode_hints`, or None when there are none of this format."""
    if stored is None or stored[:1] != _FORMAT:
        return None
    return _decode(stored, True, True)


def hints_of(event: Event, prose: bool = True) -> Hints:
    """An event's topic candidates: as stored at append, else extracted now (same result).

    ``prose=False``: its exact strings only (a prose-only event costs no decoding).
    """
    stored = event.hints
    if stored == _FORMAT:  # the common case, settled without a call: nothing worth a hint
        return ()
    if stored is not None and not prose and stored[:3] == _NO_EXACT:
        return ()
    flat = None if stored is None or stored[:1] != _FORMAT else _decode(stored, True, prose)
    if flat is None:
        flat = event_hints(event)
        if not prose:
            flat = flat[: _split(flat)]
    return flat


def _stride(events: int) -> int:
    return max(1, -(-events // PROSE_SAMPLE))


def prose_read(events: int) -> int:
    """Of a span of ``events`` events, how many :func:`span_hints` reads the words of."""
    return len(range(0, events, _stride(events)))


def span_hints(events: Sequence[Event]) -> list[Hints]:
    """The candidates a fold ranks for a span, one per event: every event's exact strings,
    and the prose words of at most :data:`PROSE_SAMPLE` events, evenly spread (a function
    of the span alone, so a live and a revived working set fold to the same marker)."""
    stride = _stride(len(events))
    return [hints_of(e, prose=i % stride == 0) for i, e in enumerate(events)]


def rank_topics(
    hints: Iterable[Hints],
    limit: int = 8,
    background: Background | None = None,
    events: int = 0,
) -> tuple[str, ...]:
    """Up to ``limit`` topics of a span, best first: weight x events it appears in.

    Exact strings come first: they are what a later query misses. Prose words (the
    salient words of each event, against common English) have ``limit // 4`` places
    when there are exact strings to name, and every place when there are none, so a
    span of plain conversation still says what it was about. With the conversation's
    ``background`` (``events``: how many of the span's events had their words read),
    prose words rank by tf x idf against it, and a word in most of the conversation is
    no topic (:func:`~torpor.compaction.background.salience`). Ties go to the topic
    seen first, so the result depends only on the span and the background.
    """
    scores: dict[str, int] = {}
    prose: dict[str, int] = {}
    for flat in hints:
        if not flat:  # most events: a fold over thousands of them must not pay per event
            continue
        for i in range(0, len(flat), 2):
            topic = flat[i + 1]
            assert isinstance(topic, str)
            weight = flat[i]
            assert isinstance(weight, int)
            if weight == PROSE_WEIGHT:
                prose[topic] = prose.get(topic, 0) + 1
            else:
                scores[topic] = scores.get(topic, 0) + weight
    ranked = _best(scores, limit)
    salient = salience(prose, events, background) if prose else None
    weighed: dict[str, int] | dict[str, float] = prose if salient is None else salient
    if not weighed:
        return ranked
    exact = {topic.lower() for topic in ranked}
    words = [w for w in _best(weighed, limit) if w not in exact]
    room = max(limit // 4, limit - len(ranked))
    words = words[:room]
    return (*ranked[: limit - len(words)], *words)


def _best(scores: dict[str, int] | dict[str, float], limit: int) -> tuple[str, ...]:
    if limit == 1:  # a call's topic label, every call: no sort (max keeps the first of ties)
        return (max(scores, key=scores.__getitem__),) if scores else ()
    order = {topic: i for i, topic in enumerate(scores)}
    return tuple(sorted(scores, key=lambda t: (-scores[t], order[t]))[:limit])


def extract_topics(events: Sequence[Event], limit: int = 8) -> tuple[str, ...]:
    """Up to ``limit`` exact strings from a span of events, best first; deterministic.

    Kinds, from most to least telling: URLs, paths, hashes, ``key=value``
    parameters, backquoted code, identifiers, numbers with units, quoted
    strings, acronyms, capitalised terms (mid-sentence only).
    """
    return rank_topics(span_hints(events), limit)


def make_marker(
    events: Sequence[Event],
    max_topics: int = 8,
    hints: Sequence[Hints] | None = None,
    background: Background | None = None,
) -> Marker:
    """A level-0 marker for one folded span (``events`` in log order, non-empty).

    ``hints``: the events' candidates if already extracted (one per event, as
    :func:`span_hints` gives them). ``background``: the conversation's before the span.
    """
    if not events:
        raise ValueError("a marker needs at least one event")
    head, tail = events[0], events[-1]
    topics = rank_topics(
        hints if hints is not None else span_hints(events),
        max_topics,
        background,
        prose_read(len(events)),
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
    if not checkpoint.markers and not checkpoint.summary and not checkpoint.memory:
        return ""
    # The memory bundle (design source 002's snapshot) comes before the markers and stands
    # in for the narrative summary, whose episodes and facts it already holds.
    lines = [checkpoint.memory, HANDOFF_HEADER] if checkpoint.memory else [HANDOFF_HEADER]
    lines.extend(format_marker(m) for m in checkpoint.markers)
    if checkpoint.summary and not checkpoint.memory:
        lines.append("Summary of the folded turns:")
        lines.append(checkpoint.summary)
    return "\n".join(lines)
