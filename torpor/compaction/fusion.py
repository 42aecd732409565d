"""Hybrid recall: full-text and vector rankings fused, by default by a weighted sum.

Full-text search finds exact strings (paths, hashes, identifiers) that vectors
blur; vectors find paraphrases that share no token with the query. Each ranks
its own candidates. The default fusion (:func:`weighted`) adds the two 0-1 scores
(full text's share of the query, the cosine similarity) weighted
``1 - VECTOR_WEIGHT`` and ``VECTOR_WEIGHT``. Measured on ``bench/hybrid_recall.py``
(paraphrased needles, 1,000 events): recall@1 0.74 and @10 0.92 at weight 0.7 (0.52
and 0.56 at 0.5), against 0.36 and 0.94 for reciprocal rank fusion, which dilutes a hit
only the vectors find (the vectors alone: 0.88 and 0.98); at 200 events 1.0 and 1.0
against 0.76 and 1.0. Reciprocal rank fusion stays available (``fusion="rrf"``): it
(Cormack et al., 2009) adds ``1 / (RRF_K + rank)`` over the lists a hit appears in,
so neither list's raw
scores (bm25, ts_rank, cosine) need to be comparable. ``RRF_K = 60`` is the
constant of the original paper: it damps the head of each list so that a hit
ranked well by both beats one ranked first by only one.

Scores stay on the one 0-1 scale of :mod:`torpor.store.hits`: a fused hit's
score is the larger of its full-text score (the share of the query it holds)
and its cosine similarity to the query (clamped to 0-1), capped by the score of
every hit fused above it, so scores never rise down the list and a threshold
keeps a prefix. ``rank`` carries the fused value (weighted sum or RRF).

Events newer than the embedder's progress mark have no vector yet; full-text
search covers them (it indexes every event at append), so the lag of the
background embedding never hides the recent tail.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from torpor._logging import get_logger
from torpor.errors import ModelError
from torpor.events import kind_of, searchable_text
from torpor.llm.embedding import Embedder, check_vectors, space_of
from torpor.store.fulltext import snippet
from torpor.store.hits import left_out
from torpor.store.protocol import EventStore, SearchHit
from torpor.store.vectors import VectorIndex

__all__ = ["FUSIONS", "RRF_K", "VECTOR_WEIGHT", "HybridRecall", "fuse", "weighted"]

log = get_logger(__name__)

RRF_K = 60
"""Reciprocal rank fusion's constant (the paper's value; larger flattens the head)."""

MIN_CANDIDATES = 20  # each side's list is at least this deep, so fusion has overlap to find

VECTOR_WEIGHT = 0.7
"""Weighted fusion's share of the cosine similarity (the full-text score has the rest)."""

FUSIONS = ("weighted", "rrf")


def weighted(
    text: Sequence[tuple[int, float]], near: Sequence[tuple[int, float]],
    weight: float = VECTOR_WEIGHT, floor: float = 0.0,
) -> list[tuple[int, float]]:
    """Two best-first lists of (position, score on the 0-1 scale) fused by a weighted sum
    of the scores: (position, fused), best first. A position the vectors did not list
    scores ``floor`` there (the caller passes the last listed similarity when the list
    was cut at its depth: the event is at most that close), one full text did not list
    scores 0. Unlike reciprocal rank fusion, a hit only one side finds keeps what that
    side thinks of it: a close paraphrase with no shared word is not pushed below every
    hit sharing a common word.

    Ties go to the position ranked best in either list, then to the newer event.
    """
    scores: dict[int, float] = {}
    best: dict[int, int] = {}
    listed = {position for position, _ in near}
    floor = min(1.0, max(0.0, floor))
    for share, ranking in ((1.0 - weight, text), (weight, near)):
        for rank, (position, score) in enumerate(ranking, start=1):
            value = share * min(1.0, max(0.0, score))
            scores[position] = scores.get(position, 0.0) + value
            best[position] = min(best.get(position, rank), rank)
    for position, _ in text:
        if position not in listed:
            scores[position] += weight * floor
    order = sorted(scores, key=lambda p: (-scores[p], best[p], -p))
    return [(position, scores[position]) for position in order]


def fuse(rankings: Sequence[Sequence[int]], k: int = RRF_K) -> list[tuple[int, float]]:
    """Positions of several best-first rankings, fused: (position, RRF score), best first.

    Ties go to the position ranked best in any list, then to the newer event.
    """
    scores: dict[int, float] = {}
    best: dict[int, int] = {}
    for ranking in rankings:
        for rank, position in enumerate(ranking, start=1):
            scores[position] = scores.get(position, 0.0) + 1.0 / (k + rank)
            best[position] = min(best.get(position, rank), rank)
    order = sorted(scores, key=lambda p: (-scores[p], best[p], -p))
    return [(position, scores[position]) for position in order]


class HybridRecall:
    """Full-text search fused with the nearest vectors of one embedder's space."""

    def __init__(
        self, embedder: Embedder, vectors: VectorIndex, fusion: str = "weighted"
    ) -> None:
        if fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {FUSIONS}, not {fusion!r}")
        self.embedder = embedder
        self.vectors = vectors
        self.space = space_of(embedder)
        self.fusion = fusion

    async def search(
        self,
        store: EventStore,
        conversation_id: str,
        query: str,
        k: int,
        exclude_tools: frozenset[str] = frozenset(),
    ) -> list[SearchHit]:
        """``exclude_tools``: results of these tools are left out, on both sides."""
        depth = max(2 * k, MIN_CANDIDATES)
        text_hits = await store.search(conversation_id, query, depth, exclude_tools=exclude_tools)
        near = await self._nearest(conversation_id, query, depth)
        if not near:
            return text_hits[:k]
        by_position = {hit.position: hit for hit in text_hits}
        similarity = dict(near)
        if self.fusion == "rrf":
            fused = fuse([[hit.position for hit in text_hits], [p for p, _ in near]])[:k]
        else:
            floor = near[-1][1] if len(near) >= depth else 0.0
            fused = weighted([(hit.position, hit.score) for hit in text_hits], near,
                             floor=floor)[:k]
        out: list[SearchHit] = []
        ceiling = 1.0
        for position, rrf in fused:
            hit = by_position.get(position)
            if hit is None:
                hit = await self._vector_hit(
                    store, conversation_id, position, query, exclude_tools
                )
                if hit is None:
                    continue
            text_score = hit.score if position in by_position else 0.0
            vector_score = min(1.0, max(0.0, similarity.get(position, 0.0)))
            ceiling = min(ceiling, max(text_score, vector_score))
            out.append(msgspec.structs.replace(hit, score=round(ceiling, 6), rank=rrf))
        return out

    async def _nearest(
        self, conversation_id: str, query: str, depth: int
    ) -> list[tuple[int, float]]:
        """The vector side; empty (full-text alone) when the query cannot be embedded."""
        try:
            vectors = check_vectors(self.embedder, [query], await self.embedder.embed([query]))
        except ModelError as exc:
            log.warning("recall_embedding_failed", conversation=conversation_id, error=str(exc))
            return []
        return await self.vectors.nearest(conversation_id, self.space, vectors[0], depth)

    @staticmethod
    async def _vector_hit(
        store: EventStore,
        conversation_id: str,
        position: int,
        query: str,
        exclude_tools: frozenset[str],
    ) -> SearchHit | None:
        events = await store.read_range(conversation_id, position, position)
        if not events or left_out(events[0].body, exclude_tools):
            return None
        event = events[0]
        return SearchHit(
            position=event.position,
            kind=kind_of(event.body),
            turn=event.turn,
            created_at=event.created_at,
            snippet=snippet(searchable_text(event.body), query),
            score=0.0,
        )
