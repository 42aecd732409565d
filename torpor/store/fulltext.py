"""Full-text query quoting and snippets, shared by every backend.

A user's query is free text (a hash, a file path, ``error: can't open``), not a
query language. Each whitespace-separated term becomes a quoted phrase, so
punctuation inside it is matched literally by the tokenizer instead of being
read as FTS5 syntax; terms are OR-ed and bm25 ranks events matching more of
them higher, which is what recall wants.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torpor.store.normalise import fold_letters, index_form, query_form

__all__ = [
    "MAX_QUERY_TERMS",
    "PARTIAL_CREDIT",
    "calibrated",
    "coverage",
    "first_match",
    "match_expression",
    "query_terms",
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


def coverage(text: str, query: str) -> float:
    """How much of ``query`` the text holds, from 0 to 1: the mean over query terms of
    1 (the term's tokens occur in order, as both indexes match a term), 0.5 (all of its
    words occur, apart: PostgreSQL's identifier fallback) or 0.

    Computed from the text alone, the same way for every backend, in the form both
    index (:func:`~torpor.store.normalise.index_form`: "Zoë" holds ``zoe``, "20,000"
    holds ``20000``): the basis of the calibrated score (:func:`calibrated`).
    """
    terms = query_terms(query)
    if not terms:
        return 0.0
    tokens = _tokens(index_form(text))
    words = set(tokens.split())
    total = 0.0
    for term in terms:
        parts = _TOKEN.findall(term.lower())
        if not parts:
            continue
        if " " + " ".join(parts) + " " in tokens:
            total += 1.0
        elif all(part in words for part in parts):
            total += PARTIAL_CREDIT
    return total / len(terms)


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


def snippet(text: str, query: str, width: int = SNIPPET_CHARS) -> str:
    """A window of ``text`` around the first place a query term occurs.

    Computed here rather than by FTS5 because the index is contentless (it keeps
    no copy of the text, which makes indexing about three times faster).
    """
    best = first_match(text, query)
    if best < 0:
        return text[:width] + ("…" if len(text) > width else "")
    start = max(0, best - width // 4)
    end = min(len(text), start + width)
    prefix = "…" if start > 0 else ""
    suffix = "…" if end < len(text) else ""
    return prefix + text[start:end] + suffix
