"""What PostgreSQL full-text search indexes for an event, and how a query is matched.

Choice (documented here because it is the contract): documents are
``to_tsvector('simple', text)``: the ``simple`` configuration lowercases and
keeps every token, with no stemming and no stop words, so an exact word is
found as written, in any language (case folding of non-ASCII letters follows
the database's ``LC_CTYPE``: a ``C``-locale database folds ASCII only).
PostgreSQL's parser already keeps many
technical tokens whole (``src/torpor/store/batch.py`` is one *file* token,
``3f9a2c1e77b0`` one *numword*, ``needle-b7e4`` a hyphenated word *and* its
parts), but which token type it picks depends on the neighbouring characters,
and a path's inner words are not indexed at all. So each document also gets
**identifier lexemes**, computed here, identically for documents and queries:

* an identifier is a run of word characters and ``. - / @ # + ~`` with the
  punctuation at its edges stripped, that contains some punctuation
  (``src/torpor/store/batch.py``, ``foo.bar_baz``, ``a@b.com``); ``:`` ``=``
  quotes and brackets end a run, so ``"path":"x/y.py"`` and ``y.py:42``
  yield ``x/y.py`` and ``y.py``;
* a document gets, for every identifier: the whole identifier, each tail after
  a ``/`` (``store/batch.py``, ``batch.py``), and its words (``batch``, ``py``),
  all lowercased;
* each whitespace-separated query term matches as ``phraseto_tsquery('simple',
  term)`` (the parser's tokens, in order), **or** as its identifiers (AND-ed),
  **or** as all the words of its identifiers (so ``torpor/store`` still finds
  ``src/torpor/store/batch.py``, ranked lower than an exact hit).

Scores are ``ts_rank`` summed over the query terms, so an event matching more
terms ranks higher (PostgreSQL has no idf: unlike bm25 a rare term does not
outweigh a common one). Long texts are indexed in chunks of
:data:`CHUNK_CHARS`, each well under PostgreSQL's 1 MB ``tsvector`` limit; an
event's score is its best chunk's.
"""

from __future__ import annotations

import re

from torpor.store.fulltext import MAX_QUERY_TERMS, query_terms

__all__ = [
    "CHUNK_CHARS",
    "MAX_LEXEME_CHARS",
    "MAX_QUERY_TERMS",
    "document_chunks",
    "identifier_lexemes",
    "query_identifiers",
    "search_terms",
]

CHUNK_CHARS = 64 * 1024
MAX_LEXEME_CHARS = 256  # longer identifiers are only indexed by their parts

_EDGE = ".-/@#+~"
# The maximal run of word characters and _EDGE marks, minus the marks at its edges,
# when marks remain inside it: words joined by marks.
_IDENTIFIER = re.compile(r"(?<!\w)\w+(?:[.\-/@#+~]+\w+)+")
_WORD = re.compile(r"\w+")


def _identifiers(text: str) -> list[str]:
    """Runs of word characters joined by punctuation, lowercased (edges never included)."""
    if not any(mark in text for mark in _EDGE):  # most prose: skip the regex
        return []
    return [token.lower() for token in _IDENTIFIER.findall(text)]


def identifier_lexemes(text: str) -> str:
    """The extra lexemes of a document, space-separated and deduplicated ('' if none).

    Lexemes never contain whitespace, quotes or backslashes, so the space-joined
    string splits back exactly (``string_to_array(…, ' ')`` on the server).
    """
    lexemes: dict[str, None] = {}
    for token in _identifiers(text):
        if len(token) <= MAX_LEXEME_CHARS:
            lexemes[token] = None
            at = token.find("/")
            while at >= 0:
                tail = token[at + 1 :].strip(_EDGE)
                if tail:
                    lexemes[tail] = None
                at = token.find("/", at + 1)
        for word in _WORD.findall(token):
            if len(word) <= MAX_LEXEME_CHARS:
                lexemes[word] = None
    return " ".join(lexemes)


def query_identifiers(term: str) -> str:
    """The identifier alternative of one query term as tsquery text, '' if it has none.

    ``'src/a.py' | 'src' & 'a' & 'py'``: the whole identifiers, or failing that
    all of their words (so ``torpor/store`` finds ``src/torpor/store/batch.py``,
    ranked below an exact hit). Lexemes are quoted; they hold no quote or
    backslash, so quoting is exact.
    """
    tokens = [t for t in _identifiers(term) if len(t) <= MAX_LEXEME_CHARS]
    if not tokens:
        return ""
    whole = " & ".join(f"'{token}'" for token in dict.fromkeys(tokens))
    words = " & ".join(f"'{w}'" for w in dict.fromkeys(_WORD.findall(" ".join(tokens))))
    return f"({whole}) | ({words})"


def search_terms(query: str) -> tuple[list[str], list[str]]:
    """The query's terms (at most :data:`MAX_QUERY_TERMS`) and their identifier alternatives."""
    terms = query_terms(query)  # NUL-free: torpor.store.arguments.search_query
    return terms, [query_identifiers(t) for t in terms]


def document_chunks(text: str) -> list[tuple[str, str]]:
    """``(text, identifier lexemes)`` per chunk; cut at whitespace where one is near.

    The text holds no NUL (PostgreSQL text could not): appends refuse it.
    """
    if len(text) <= CHUNK_CHARS:
        return [(text, identifier_lexemes(text))]
    chunks = []
    start = 0
    while start < len(text):
        end = min(len(text), start + CHUNK_CHARS)
        if end < len(text):
            space = text.rfind(" ", end - 1024, end)
            if space > start:
                end = space
        piece = text[start:end]
        chunks.append((piece, identifier_lexemes(piece)))
        start = end
    return chunks
