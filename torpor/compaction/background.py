"""The conversation's background: what its folded events are commonly about.

A marker's prose topics should say what a span is about *in this conversation*:
in a chat where every message mentions "kubernetes", that word tells one span
from another no better than "the" does. So each checkpoint carries the document
frequencies of prose words over the events it covers (:class:`Background`),
bounded to the :data:`BACKGROUND_WORDS` most frequent, and a fold scores its
span's words by tf-in-span x idf-against-the-conversation. Updated once per fold
from the words the fold already read (the events' hints, stored at append), and
persisted with the checkpoint, so a revived working set folds to the same marker
as a live one without reading the log, at a cost independent of its length.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from torpor.store.protocol import Background

__all__ = [
    "BACKGROUND_MIN_EVENTS",
    "BACKGROUND_WORDS",
    "grow",
    "salience",
    "word_counts",
]

BACKGROUND_WORDS = 256
"""Prose words a background keeps (the most frequent): a word rarer than all of them
counts as absent, which is what a word outside the top few hundred nearly is."""

BACKGROUND_MIN_EVENTS = 16
"""Events a background needs before it is trusted: below that (a short conversation, the
first fold) prose words are ranked against common English alone, by their count."""


def grow(previous: Background | None, counts: dict[str, int], events: int) -> Background:
    """``previous`` plus one span: ``counts`` (word -> events of the span holding it) over
    ``events`` events; the :data:`BACKGROUND_WORDS` most frequent kept (ties: alphabetical,
    so the result depends only on the log)."""
    merged = dict(counts)
    total = events
    if previous is not None:
        total += previous.events
        for word, count in zip(previous.words, previous.counts, strict=True):
            merged[word] = merged.get(word, 0) + count
    kept = sorted(merged, key=lambda w: (-merged[w], w))[:BACKGROUND_WORDS]
    return Background(
        events=total, words=tuple(kept), counts=tuple(merged[w] for w in kept)
    )


def salience(
    counts: dict[str, int], events: int, background: Background | None
) -> dict[str, float] | None:
    """Scores of a span's prose words (``counts``: word -> events of the span holding it,
    of ``events`` read): tf x idf against the background with the span added. A word in
    half or more of those events is background, not a topic: left out. None when the
    background is too small to judge (rank by count then)."""
    if background is None or background.events < BACKGROUND_MIN_EVENTS:
        return None
    frequency = dict(zip(background.words, background.counts, strict=True))
    total = background.events + events
    out: dict[str, float] = {}
    for word, tf in counts.items():
        df = frequency.get(word, 0) + tf
        if 2 * df >= total:
            continue
        out[word] = tf * math.log((total + 1) / (df + 1))
    return out


def word_counts(hints: Iterable[tuple[int | str, ...]], prose_weight: int) -> dict[str, int]:
    """Word -> events holding it, from events' flattened hints (prose words only)."""
    counts: dict[str, int] = {}
    for flat in hints:
        for i in range(0, len(flat), 2):
            if flat[i] == prose_weight:
                word = flat[i + 1]
                assert isinstance(word, str)
                counts[word] = counts.get(word, 0) + 1
    return counts
