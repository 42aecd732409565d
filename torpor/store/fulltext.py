"""Full-text query quoting and snippets, shared by every backend.

A user's query is free text (a hash, a file path, ``error: can't open``), not a
query language. Each whitespace-separated term becomes a quoted phrase, so
punctuation inside it is matched literally by the tokenizer instead of being
read as FTS5 syntax; terms are OR-ed and bm25 ranks events matching more of
them higher, which is what recall wants.
"""

from __future__ import annotations

import re

__all__ = ["MAX_QUERY_TERMS", "first_match", "match_expression", "query_terms", "snippet"]

_WORD = re.compile(r"\w+")
SNIPPET_CHARS = 160
MAX_QUERY_TERMS = 64  # more is not a query but a document; FTS5 would refuse the expression


def query_terms(query: str) -> list[str]:
    """Whitespace-separated terms that contain at least one word character (the first 64)."""
    return [term for term in query.split() if _WORD.search(term)][:MAX_QUERY_TERMS]


def match_expression(query: str) -> str | None:
    """An FTS5 MATCH expression for ``query``; None when it has nothing searchable."""
    terms = query_terms(query)
    if not terms:
        return None
    return " OR ".join('"' + term.replace('"', '""') + '"' for term in terms)


def first_match(text: str, query: str) -> int:
    """Index of the earliest occurrence of a query term (or a word of one) in ``text``, or -1."""
    lowered = text.lower()
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
