"""Search hits and artifact bytes from stored rows: the same on both backends.

The backends find the matching rows their own way (FTS5 and bm25 on SQLite,
tsvector and ts_rank on PostgreSQL); what a hit then says, and when a clipped
tool result is searched beyond its preview, is decided here once. Hybrid recall
(:mod:`torpor.compaction.fusion`) keeps the same 0-1 scale for its fused hits.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import msgspec

from torpor.errors import StoreError, UnknownArtifact
from torpor.events import AssistantMessage, Body, ToolResult, kind_of, searchable_text
from torpor.store.clip import artifact_of, expanded
from torpor.store.fulltext import calibrated, coverage, snippet
from torpor.store.protocol import SearchHit

__all__ = [
    "Found",
    "artifact_bytes",
    "beyond_preview",
    "deeper",
    "expanded_text",
    "left_out",
    "scored",
    "search_hit",
    "search_text",
]


def left_out(body: Body, exclude: frozenset[str]) -> bool:
    """Whether a search leaves this row out: the result of a tool named in ``exclude``,
    or an assistant message that only calls such tools (a ``recall`` call's arguments
    are an earlier query: it would match a later one word for word).

    Filtered when the query runs, not when the row is indexed, so the index stays
    the same and a caller who wants those rows gets them."""
    if not exclude:
        return False
    if isinstance(body, ToolResult):
        return body.tool in exclude
    if isinstance(body, AssistantMessage) and body.tool_calls and not body.text:
        return all(call.name in exclude for call in body.tool_calls)
    return False


def search_text(body: Body, query: str, exclude: frozenset[str]) -> str | None:
    """The text a hit on this row is scored and quoted from; None: the search leaves it out
    (:func:`left_out`, or it holds the query only in calls of tools named in ``exclude``,
    whose arguments are not evidence: they are left out of the text)."""
    if left_out(body, exclude):
        return None
    if (
        exclude
        and isinstance(body, AssistantMessage)
        and any(call.name in exclude for call in body.tool_calls)
    ):
        calls = tuple(call for call in body.tool_calls if call.name not in exclude)
        text = searchable_text(msgspec.structs.replace(body, tool_calls=calls))
        return text if coverage(text, query) > 0.0 else None
    return searchable_text(body)


def deeper(k: int, limit: int, fetched: int, kept: int) -> int | None:
    """The next ranked-row limit of a search that leaves rows out (None: done): more rows
    only while fewer than ``k`` were kept and the last query filled its ``limit``."""
    if kept >= k or fetched < limit:
        return None
    return limit * 4


def beyond_preview(body: Body, text: str, query: str) -> str | None:
    """The artifact that holds a clipped body's full text, when the preview does not hold
    all of ``query`` (the rest may lie beyond it)."""
    artifact = artifact_of(body)
    if artifact is not None and coverage(text, query) < 1.0:
        return artifact
    return None


def expanded_text(body: Body, full: bytes) -> str:
    """A clipped body's searchable text with its artifact's full content in place."""
    return searchable_text(expanded(body, full.decode("utf-8", "replace")))


Found = tuple[SearchHit, float, float]
"""A hit, the share of the query its text holds, and that share weighted by rarity."""


def search_hit(
    body: Body,
    *,
    position: int,
    turn: int,
    created_at: int,
    text: str,
    query: str,
    rank: float,
    weights: Sequence[float] | None = None,
) -> Found:
    """A hit with the backend's own ``rank``, the share of the query its text holds, and
    that share with each term weighted by its rarity (``weights``, see
    :func:`~torpor.store.fulltext.term_weights`; None: all alike)."""
    hit = SearchHit(
        position=position,
        kind=kind_of(body),
        turn=turn,
        created_at=created_at,
        snippet=snippet(text, query),
        score=0.0,
        rank=rank,
    )
    share = coverage(text, query)
    return hit, share, share if weights is None else coverage(text, query, weights)


def scored(found: Sequence[Found]) -> list[SearchHit]:
    """Hits with scores on the one 0-1 scale (see store.fulltext), the rarity-weighted
    share of the query first, the backend's order among equal shares (its SQL already puts
    the events holding more of the rare terms first; the share refines that: a phrase held
    apart counts half). The score stays the plain share, capped down the list."""
    ordered = sorted(found, key=lambda one: -one[2])  # stable: the backend's order kept
    scores = calibrated([share for _, share, _ in ordered])
    return [
        msgspec.structs.replace(hit, score=score)
        for (hit, _, _), score in zip(ordered, scores, strict=True)
    ]


def artifact_bytes(artifact_id: str, data: bytes | None) -> bytes:
    """An artifact row's stored data (None: there is no such row) as the original bytes."""
    if data is None:
        raise UnknownArtifact(artifact_id)
    try:
        return zlib.decompress(data)
    except zlib.error as exc:
        raise StoreError(f"artifact {artifact_id!r} is corrupt: {exc}") from exc
