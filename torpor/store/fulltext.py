"""Full-text query quoting and snippets, shared by every backend.

A user's query is free text (a hash, a file path, ``error: can't open``), not a
query language. Each whitespace-separated term becomes a quoted phrase, so
punctuation inside it is matched literally by the tokenizer instead of being
read as FTS5 syntax; terms are OR-ed.

Ranking (the same rule in both backends' SQL): an event holding more of the
query's distinct terms ranks first, each term counted by its rarity in the
conversation (:func:`rarity`: a word most events hold counts little, a word few
hold counts much), so a short fact holding the two rare words of a question
outranks a long event holding its three common ones by chance, while bm25 alone,
which gives a common word almost no weight, would let long events repeating one
or two common words outrank a short event holding every query word; among events
holding as much, the backend's own relevance (bm25 on
SQLite, ts_rank on PostgreSQL) divided by :func:`length_factor` of the event's
stored size, so a short event beats a long repetitive one that holds the same
words (neither backend's score does that here: FTS5's bm25 has no document
lengths in a contentless ``columnsize=0`` index, and ts_rank is not normalised).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence

from torpor.store.normalise import fold_letters, index_form, query_form

__all__ = [
    "MAX_QUERY_TERMS",
    "PARTIAL_CREDIT",
    "calibrated",
    "coverage",
    "first_match",
    "length_factor",
    "ranking_phrases",
    "ranking_terms",
    "rarity",
    "term_weights",
    "match_expression",
    "term_groups",
    "term_phrases",
    "query_terms",
    "best_region",
    "snippet",
]

_WORD = re.compile(r"\w+")
SNIPPET_CHARS = 160
MAX_QUERY_TERMS = 64  # more is not a query but a document; FTS5 would refuse the expression


def query_terms(query: str) -> list[str]:
    """Whitespace-separated terms of the query in the index's form (diacritics folded,
    digit grouping removed: :func:`~torpor.store.normalise.query_form`) that contain at
    least one word character (the first 64)."""
    return [term for term in query_form(query).split() if _WORD.search(term)][:MAX_QUERY_TERMS]


PARTIAL_CREDIT = 0.5
"""Credit for a query term whose words all occur in a hit, but not as the phrase."""

_TOKEN = re.compile(r"[^\W_]+")  # what both indexes split on: letters and digits, not "_"


def _tokens(text: str) -> str:
    """The text's index tokens, lowercased, joined and framed by single spaces."""
    return " " + " ".join(_TOKEN.findall(text.lower())) + " "


def coverage(text: str, query: str, weights: Sequence[float] | None = None) -> float:
    """How much of ``query`` the text holds, from 0 to 1: the mean over query terms of
    1 (the term's tokens occur in order, as both indexes match a term), 0.5 (all of its
    words occur, apart: PostgreSQL's identifier fallback) or 0.

    ``weights``: one per :func:`ranking_terms` term (:func:`term_weights`), a weighted
    mean over those instead, what hits are ranked by (an adjacent pair of query words
    counts only held as written, as the indexes match it).

    Computed from the text alone, the same way for every backend, in the form both
    index (:func:`~torpor.store.normalise.index_form`: "Zoë" holds ``zoe``, "20,000"
    holds ``20000``): the basis of the calibrated score (:func:`calibrated`).
    """
    terms = query_terms(query)
    if not terms:
        return 0.0
    single = len(terms)
    if weights is None:
        weights = [1.0] * single
    else:
        terms = ranking_terms(query)
        if len(weights) != len(terms):
            return coverage(text, query)
    tokens = _tokens(index_form(text))
    words = set(tokens.split())
    total = 0.0
    for i, (term, weight) in enumerate(zip(terms, weights, strict=True)):
        parts = _TOKEN.findall(term.lower())
        if not parts:
            continue
        if " " + " ".join(parts) + " " in tokens:
            total += weight
        elif i < single and all(part in words for part in parts):
            total += PARTIAL_CREDIT * weight
    whole = sum(weights)
    return total / whole if whole > 0.0 else 0.0


def ranking_terms(query: str) -> list[str]:
    """What ranking weighs: the query's terms (:func:`query_terms`), then each adjacent
    pair of them as a phrase ("mailer migration", "migration incident"), so an event
    holding the question's words together, as written, outranks one holding them apart
    by chance across a long text (the pairs rank; they do not score)."""
    terms = query_terms(query)
    return terms + [f"{a} {b}" for a, b in itertools.pairwise(terms)]


def ranking_phrases(query: str) -> list[str]:
    """One FTS5 phrase per distinct :func:`ranking_terms` term (case folded)."""
    return ['"' + term.replace('"', '""') + '"' for term in _distinct(ranking_terms(query))]


def rarity(events: int, holding: int) -> float:
    """A query term's weight in the ranking: ``ln(1 + events / holding)`` of the
    conversation's event count and how many of them hold the term (at least 1: a term
    no event holds as a phrase may still be held apart). The same expression in both
    backends' SQL: 0.69 for a word every event holds, 3.0 for one in 1 of 20, 7.8 in
    1 of 2,400, so two rare words outweigh three common ones."""
    return math.log1p(max(events, 1) / max(holding, 1))


def term_weights(query: str, events: int, holding: Sequence[int]) -> list[float]:
    """One :func:`rarity` per :func:`ranking_terms` term from ``holding``, the count of
    events holding each distinct one (:func:`ranking_phrases` order)."""
    groups = term_groups(ranking_terms(query))
    slot = {group: i for i, group in enumerate(sorted(set(groups)))}
    return [rarity(events, holding[slot[group]]) for group in groups]


def calibrated(coverages: Sequence[float]) -> list[float]:
    """Scores on the one scale every backend reports, for hits in the backend's order.

    The scale: a hit's score is the share of the query it holds (:func:`coverage`;
    1.0: every term, as written), capped by the score of every hit the backend ranked
    above it. So scores never rise down a result list (monotone with the backend's own
    ranking, bm25 or ts_rank), a threshold keeps a prefix of it, and the same hit scores
    the same on SQLite and PostgreSQL wherever the two rank it below no hit that holds
    less of the query (the raw ``rank`` stays on the hit, in the backend's own units).
    """
    out: list[float] = []
    ceiling = 1.0
    for value in coverages:
        ceiling = min(ceiling, value)
        out.append(round(ceiling, 6))
    return out


def match_expression(query: str) -> str | None:
    """An FTS5 MATCH expression for ``query``; None when it has nothing searchable."""
    terms = query_terms(query)
    if not terms:
        return None
    return " OR ".join('"' + term.replace('"', '""') + '"' for term in terms)


def term_phrases(query: str) -> list[str]:
    """One FTS5 phrase per distinct query term (case folded): what counts as one term held."""
    return ['"' + term.replace('"', '""') + '"' for term in _distinct(query_terms(query))]


def term_groups(terms: Sequence[str]) -> list[int]:
    """For each term, the index of the first term equal to it case folded (its group)."""
    first: dict[str, int] = {}
    return [first.setdefault(term.lower(), i) for i, term in enumerate(terms)]


def _distinct(terms: Sequence[str]) -> list[str]:
    groups = term_groups(terms)
    return [term for i, term in enumerate(terms) if groups[i] == i]


LENGTH_BYTES = 64.0
"""The stored size at which :func:`length_factor` starts to grow in earnest."""


def length_factor(size: int) -> float:
    """What a backend's relevance is divided by among events holding as many query terms:
    ``1 + ln(1 + size / 64)`` of the event's stored body size in bytes (the same
    expression in both backends' SQL: 1 for nothing, 1.6 for a one-line fact, 2.4 for a
    200-byte message, 6.3 for 12 KB). Logarithmic, as PostgreSQL's own length
    normalisation; steep enough at small sizes that a message repeating a common query
    word three times does not outrank a one-line fact holding it once (ts_rank saturates
    a word's repeats less than bm25 does)."""
    return 1.0 + math.log1p(size / LENGTH_BYTES)


def first_match(text: str, query: str) -> int:
    """Index of the earliest occurrence of a query term (or a word of one) in ``text``, or -1
    (diacritics folded letter for letter, so offsets stay those of ``text``)."""
    lowered = fold_letters(text.lower())
    best = -1
    for term in query_terms(query):
        for candidate in (term, *_WORD.findall(term)):
            at = lowered.find(candidate.lower())
            if at >= 0:
                if best < 0 or at < best:
                    best = at
                break
    return best


REGION_CHARS = 400
"""The span within which query terms count as one region (a JSON record, a paragraph)."""


def _occurrences(text: str, query: str) -> list[tuple[int, int, int]]:
    """(start, end, term group) of every whole-word occurrence of a query term, by start;
    a term that does not occur as written counts by its words."""
    terms = query_terms(query)
    groups = term_groups(terms)
    found: list[tuple[int, int, int]] = []
    for group, term in enumerate(terms):
        if groups[group] != group:  # the same term again
            continue
        for candidate in (term, *_WORD.findall(term)):
            pattern = re.compile(r"(?<![^\W_])" + re.escape(candidate) + r"(?![^\W_])",
                                 re.IGNORECASE)
            hits = [(m.start(), m.end(), group) for m in pattern.finditer(text)]
            if hits:
                found.extend(hits)
                break
    found.sort()
    return found


def best_region(text: str, query: str, span: int = REGION_CHARS) -> tuple[int, int] | None:
    """(start, end) of the stretch of at most ``span`` characters holding the most distinct
    query terms (the tightest such, then the earliest), None when no term occurs."""
    found = _occurrences(text, query)
    if not found:
        return None
    best: tuple[int, int, int] | None = None  # (-terms, span, start)
    counts: dict[int, int] = {}
    low = 0
    for _, end, group in found:
        counts[group] = counts.get(group, 0) + 1
        # Drop what is out of reach, then what the window holds again later: the tightest
        # window ending here that holds as many terms.
        while found[low][0] < end - span or counts[found[low][2]] > 1:
            gone = found[low][2]
            counts[gone] -= 1
            if not counts[gone]:
                del counts[gone]
            low += 1
        candidate = (-len(counts), end - found[low][0], found[low][0])
        if best is None or candidate < best:
            best = candidate
    assert best is not None
    return best[2], best[2] + best[1]


def snippet(text: str, query: str, width: int = SNIPPET_CHARS) -> str:
    """A window of ``text`` centred on the region holding the most query terms (the first
    such): in a large JSON result, the record holding most of the query, not the first
    one holding any word of it.

    Computed here rather than by FTS5 because the index is contentless (it keeps
    no copy of the text, which makes indexing about three times faster).
    """
    region = best_region(text, query) if len(text) > width else None
    if region is None:
        return text[:width] + ("…" if len(text) > width else "")
    low, high = region
    start = max(0, min(low - width // 4, (low + high - width) // 2))
    start = min(start, max(0, len(text) - width))
    end = min(len(text), start + width)
    prefix = "…" if start > 0 else ""
    suffix = "…" if end < len(text) else ""
    return prefix + text[start:end] + suffix
