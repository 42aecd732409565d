"""Getting folded content back: search the whole log, or expand an exact range.

Both are public API and tools the model can call. Search returns scores so a
caller (or the model) can judge whether a hit is good enough or the query
should be reformulated; expand returns the exact events, full artifacts
included, so nothing a fold left out is ever out of reach.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import msgspec

from torpor.compaction.corrections import corrections
from torpor.compaction.fusion import HybridRecall
from torpor.compaction.push import ECHO_TOOLS, fact_keys
from torpor.compaction.task_card import card_lines
from torpor.errors import InvalidInput
from torpor.events import (
    Aborted,
    AssistantMessage,
    Event,
    Parked,
    Resolved,
    Spawned,
    Suspended,
    TaskCard,
    ToolResult,
    Unparked,
    UserMessage,
    kind_of,
    presented,
    searchable_text,
)
from torpor.llm.protocol import ToolSpec
from torpor.store.arguments import check_limit, check_position, search_query
from torpor.store.clip import artifact_of, expanded
from torpor.store.fulltext import snippet
from torpor.store.protocol import EventStore, SearchHit

__all__ = [
    "EXPAND_PAGE_CHARS",
    "EXPAND_TOOL",
    "RECALL_ECHOES",
    "RECALL_TOOL",
    "expand",
    "format_events",
    "format_hits",
    "recall",
]

EXPAND_PAGE_CHARS = 24_000
"""Most characters one expand call returns; longer output is read page by page."""

RECALL_TOOL = ToolSpec(
    name="recall",
    description=(
        "Search this conversation's full history, including parts folded out of your "
        "context. Use exact strings when you have them (paths, hashes, identifiers). "
        "Returns event positions, kinds, snippets and scores (0-1: share of the query "
        "found); read a hit in full with expand."
    ),
    parameters={
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "words or exact strings to find"},
            "k": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
            "include_recall_outputs": {
                "type": "boolean",
                "default": False,
                "description": "also search the outputs of earlier recall/expand calls",
            },
        },
        "required": ["query"],
        "additionalProperties": False,
    },
)

EXPAND_TOOL = ToolSpec(
    name="expand",
    description=(
        "Read events of this conversation's history exactly as logged, from position "
        "start to end (inclusive; at most 200 at once), large tool results in full, "
        "in pages: a cut page names the offset to read on from."
    ),
    parameters={
        "type": "object",
        "properties": {
            "start": {"type": "integer", "minimum": 0},
            "end": {"type": "integer", "minimum": 0},
            "offset": {"type": "integer", "minimum": 0},
            "limit": {"type": "integer", "minimum": 1_000, "maximum": EXPAND_PAGE_CHARS},
        },
        "required": ["start"],
        "additionalProperties": False,
    },
)

RECALL_ECHOES = ECHO_TOOLS  # one set: push leaves the same echoes out
"""The built-in tools whose results quote other events of the log: :func:`recall` leaves
them out unless asked, so a value an earlier recall quoted (maybe since corrected) does
not come back as if it were evidence; the events quoted are searchable themselves."""
assert {RECALL_TOOL.name, EXPAND_TOOL.name} == RECALL_ECHOES

CORRECTION_KEYS = 10
"""Most keys one recall looks up corrections for (one search each)."""

_json = msgspec.json.Encoder(order="deterministic")


async def recall(
    store: EventStore,
    conversation_id: str,
    query: str,
    k: int = 10,
    *,
    hybrid: HybridRecall | None = None,
    include_recall_outputs: bool = False,
    follow_corrections: bool = True,
) -> list[SearchHit]:
    """Full-text search over every event of the conversation, best first, scores exposed.

    The results of earlier ``recall``/``expand`` calls (:data:`RECALL_ECHOES`) are left
    out unless ``include_recall_outputs``: they quote other events, which are found
    themselves, and a quote of a since-corrected value would otherwise compete with it.

    ``follow_corrections``: a hit that sets a key (``NAME = value``, see
    :func:`~torpor.compaction.push.fact_keys`) comes right after the latest later event
    setting the same key, and a hit that a later event corrects in prose ("Scratch
    that, use eu-north-1.", see :mod:`~torpor.compaction.corrections`) right after
    that correction, scored as the hit it corrects (moved up if it ranked lower), so
    an old value never comes back without its correction, and the correction first.

    Scores are on one scale on every backend (0 to 1, :func:`torpor.store.fulltext.calibrated`),
    so a confidence gate set once holds on SQLite and PostgreSQL alike.

    ``hybrid``: fuse the full-text ranking with the nearest vectors
    (:mod:`torpor.compaction.fusion`); scores stay on the same scale.

    Bad arguments (``k`` not a positive int, ``query`` not a str) raise InvalidInput.
    """
    check_limit(k, "k")
    query = search_query(query)
    if not query.strip():
        return []
    exclude = frozenset() if include_recall_outputs else RECALL_ECHOES
    if hybrid is not None:
        hits = await hybrid.search(store, conversation_id, query, k, exclude)
    else:
        hits = await store.search(conversation_id, query, k, exclude_tools=exclude)
    if not follow_corrections:
        return hits
    return await _with_corrections(store, conversation_id, hits, exclude)


async def _with_corrections(
    store: EventStore, conversation_id: str, hits: list[SearchHit], exclude: frozenset[str]
) -> list[SearchHit]:
    """``hits``, each preceded by what corrects it: the latest later event that sets a key
    it sets, or its prose corrections (:mod:`~torpor.compaction.corrections`), newest first;
    a correction ranks with what it corrects (its score), wherever it ranked itself."""
    latest: dict[str, SearchHit | None] = {}
    before: dict[int, list[SearchHit]] = {}
    for hit in hits:
        for key in sorted(fact_keys(hit.snippet)):
            if key not in latest:
                if len(latest) == CORRECTION_KEYS:
                    continue
                found = await store.search(conversation_id, key, 10, exclude_tools=exclude)
                setters = [h for h in found if key in fact_keys(h.snippet)]
                latest[key] = max(setters, key=lambda h: h.position, default=None)
            later = latest[key]
            if later is not None and later.position > hit.position:
                before.setdefault(hit.position, []).append(later)
    for position, chain in (await _prose(store, conversation_id, hits)).items():
        before.setdefault(position, []).extend(chain)
    out: list[SearchHit] = []
    have: set[int] = set()
    for hit in hits:
        if hit.position in have:
            continue  # shown already, beside what it corrects
        fixes = sorted(before.get(hit.position, ()), key=lambda h: -h.position)
        for fix in fixes:
            if fix.position not in have:
                have.add(fix.position)
                out.append(msgspec.structs.replace(fix, score=hit.score))
        have.add(hit.position)
        out.append(hit)
    return out


async def _prose(
    store: EventStore, conversation_id: str, hits: list[SearchHit]
) -> dict[int, list[SearchHit]]:
    """Position -> the hits' prose corrections, as hits (snippets from their whole text)."""
    found = await corrections(store, conversation_id, (h.position for h in hits))
    out: dict[int, list[SearchHit]] = {}
    for position, chain in found.items():
        out[position] = [
            SearchHit(
                position=e.position,
                kind=kind_of(e.body),
                turn=e.turn,
                created_at=e.created_at,
                snippet=snippet(searchable_text(e.body), ""),
                score=0.0,
            )
            for e in chain
        ]
    return out


async def expand(store: EventStore, conversation_id: str, start: int, end: int) -> list[Event]:
    """The exact events start..end (inclusive), each with its full text: tool results,
    assistant answers and aborted answers that were clipped into artifacts come back whole."""
    check_position(start, "start")
    check_position(end, "end")
    if end < start:
        raise InvalidInput("end", f"{end} is before start ({start})")
    # A redacted event as the model is shown it (its artifact is gone with its text).
    events = [presented(e) for e in await store.read_range(conversation_id, start, end)]
    out: list[Event] = []
    for event in events:
        artifact = artifact_of(event.body)
        if artifact is not None:
            data = await store.get_artifact(artifact)
            full = expanded(event.body, data.decode("utf-8", errors="replace"))
            event = msgspec.structs.replace(event, body=full)
        out.append(event)
    return out


def _when(ms: int) -> str:
    return f"{datetime.fromtimestamp(ms / 1000.0, tz=UTC):%Y-%m-%d %H:%M:%S} UTC"


def format_hits(hits: Sequence[SearchHit]) -> str:
    """Search hits as tool-result text: one line each, position first."""
    if not hits:
        return "No matches in this conversation's log. Try other words or exact strings."
    lines = [f"{len(hits)} match(es), best first (score: share of the query found, 0 to 1):"]
    for hit in hits:
        snippet = " ".join(hit.snippet.split())
        lines.append(
            f"- event {hit.position} ({hit.kind}, turn {hit.turn}, {_when(hit.created_at)}, "
            f"score {hit.score:.3f}): {snippet}"
        )
    lines.append("Use expand(start, end) to read events in full.")
    return "\n".join(lines)


def _body_text(body: object) -> str:
    if isinstance(body, UserMessage):
        return f"user: {body.text}"
    if isinstance(body, AssistantMessage):
        parts = [f"assistant: {body.text}"] if body.text else ["assistant:"]
        for call in body.tool_calls:
            parts.append(f"  calls {call.name} [{call.id}] {_json.encode(call.arguments).decode()}")
        return "\n".join(parts)
    if isinstance(body, ToolResult):
        flag = " (error)" if body.is_error else ""
        return f"result of {body.tool} [{body.call_id}]{flag}: {body.content}"
    if isinstance(body, Suspended):
        return f"suspended awaiting {', '.join(body.call_ids)}: {body.reason}".rstrip(": ")
    if isinstance(body, Resolved):
        return f"resolved {body.call_id}"
    if isinstance(body, Aborted):
        text = f"aborted ({body.reason})"
        if body.detail:
            text += f": {body.detail}"
        if body.partial_text:
            text += f"\npartial answer: {body.partial_text}"
        return text
    if isinstance(body, Parked):
        return f"parked after {body.restarts} restarts: {body.cause}"
    if isinstance(body, Unparked):
        return f"unparked by {body.by}"
    if isinstance(body, Spawned):
        return f"sub-agent {body.child} answers {body.parent}'s call [{body.call_id}]"
    if isinstance(body, TaskCard):
        return f"task card set by {body.by}:\n{card_lines(body)}"
    return repr(body)


def format_events(
    events: Sequence[Event], max_chars: int = EXPAND_PAGE_CHARS, offset: int = 0
) -> str:
    """Events as tool-result text, oldest first: one page of at most ``max_chars`` characters.

    The events render to one text; ``offset`` says where in it this page starts.
    A page that does not reach the end says so and names the offset of the next
    one, so a model reads a 50 KB tool result in full, a page at a time, with
    nothing skipped or repeated (the footer is not part of the paged text).
    """
    if not events:
        return "No events in that range."
    if max_chars < 1:
        raise InvalidInput("limit", f"{max_chars} is not a positive number of characters")
    check_position(offset, "offset")
    text = "\n".join(
        f"--- event {event.position} (turn {event.turn}, {_when(event.created_at)}) ---\n"
        f"{_body_text(event.body)}"
        for event in events
    )
    total = len(text)
    if offset >= total and offset > 0:
        return (
            f"[offset {offset} is past the end: the output of events "
            f"{events[0].position}\u2013{events[-1].position} has {total} characters]"
        )
    end = min(total, offset + max_chars)
    page = text[offset:end]
    if offset == 0 and end == total:
        return page
    first, last = events[0].position, events[-1].position
    note = f"[characters {offset}\u2013{end} of {total}"
    if end < total:
        note += (
            f"; output cut here, call expand(start={first}, end={last}, offset={end}) "
            "to read on]"
        )
    else:
        note += "; end of output]"
    return f"{page}\n{note}"
