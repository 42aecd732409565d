"""The form text is indexed and queried in: diacritics folded, digit grouping removed.

Both backends index :func:`index_form` of an event's text and match
:func:`query_form` of a query, so ``zoe`` finds "Zoë", ``soren`` "Søren",
``lukasz`` "Łukasz" and ``20000-user`` "the 20,000-user test" (and the
reverse). The stored text is unchanged; only the index sees this form.
Decisions (the contract, as tests check it):

* **Diacritics.** A letter that decomposes into a base letter and marks of the
  Combining Diacritical Marks block (U+0300-U+036F) becomes its base (é, ë, ż,
  ǖ); combining marks written separately are dropped. Letters Unicode does not
  decompose are mapped by a small table of the usual transliterations (ø o,
  ł l, đ d, ß ss, æ ae, œ oe, þ th, ð d, ħ h, ŧ t, ŀ l, ĳ ij, and the dotless i
  and long s). Marks of other scripts (Devanagari vowel signs, Hebrew points…)
  are kept: they are not accents. Case is left to the index (both lowercase).
* **Numbers.** Digits grouped by thousands with one separator repeated
  (``20,000``, ``1,234,567``, ``20 000``, and the no-break, narrow no-break and
  thin spaces) become one run of digits (``20000``): a first group of 1-3 digits,
  then groups of exactly 3. Not merged: a dot (``3.14``, ``1.2.3`` and German
  ``20.000`` are ambiguous with decimals and versions and stay as written), a
  group run preceded by a digit and a separator (``5 12 345``: columns of a
  table) or followed by a separator and a digit (``1,234,5``: a list). So that a
  query for one of the parts still finds a merged number (a JSON array
  ``[12,345]``), the index form also ends with the parts of every number it
  merged.

Both functions return their argument itself when there is nothing to change
(most text), and find that out with byte-table passes over its UTF-8 (about 1.5 ns a
character; a regular-expression scan costs 10-75), so the append path pays little:
the regular expressions run only on text that holds a foldable letter or a digit,
a separator and three digits.

Changing either function changes what existing indexes hold: a new schema
version must reindex (see the SQLite and PostgreSQL ``schema`` modules), since
a delete or redaction removes an SQLite entry by rebuilding this exact form
(:func:`torpor.store.erase.indexed_text`).
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["FOLDED", "fold", "fold_letters", "index_form", "query_form"]

FOLDED: dict[str, str] = {
    "ø": "o", "Ø": "O", "ł": "l", "Ł": "L", "đ": "d", "Đ": "D", "ß": "ss", "ẞ": "SS",
    "æ": "ae", "Æ": "AE", "œ": "oe", "Œ": "OE", "þ": "th", "Þ": "TH", "ð": "d", "Ð": "D",
    "ħ": "h", "Ħ": "H", "\u0131": "i", "ŧ": "t", "Ŧ": "T", "ŀ": "l", "Ŀ": "L", "ĳ": "ij",
    "Ĳ": "IJ", "\u017f": "s",
}  # fmt: skip
"""Letters without a Unicode decomposition, and their usual transliteration."""

_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
_MARKS = re.compile(r"[\u0300-\u036f]")
# Where a fold can change anything: Latin-1 letters to Cyrillic (U+00C0-U+04FF, the
# combining marks included) and the Latin and Greek extended blocks (U+1E00-U+1FFF).
_FOLDABLE = re.compile(r"[\u00c0-\u04ff\u1e00-\u1fff]+")
# Their UTF-8 lead bytes (0xE1 also leads other blocks: a false alarm costs only time).
_NOT_FOLDABLE = bytes(b for b in range(256) if not (0xC3 <= b <= 0xD3 or b == 0xE1))
_CACHE_LIMIT = 1 << 16  # distinct code points remembered (CJK text meets thousands)


class _Folds(dict[int, str]):
    """Code point -> its folded text, computed on first sight (a ``str.translate`` table)."""

    def __missing__(self, code: int) -> str:
        char = chr(code)
        folded = FOLDED.get(char)
        if folded is None:
            decomposed = unicodedata.normalize("NFD", char)
            bare = _MARKS.sub("", decomposed)
            if bare == decomposed:
                folded = char  # no diacritic (Hangul decomposes too: kept whole)
            else:
                bare = unicodedata.normalize("NFC", bare)
                folded = "".join(FOLDED.get(c, c) for c in bare)  # ǿ: ø, then o
        if len(self) < _CACHE_LIMIT:
            self[code] = folded
        return folded


_FOLDS = _Folds()


def _fold_run(match: re.Match[str]) -> str:
    return match.group().translate(_FOLDS)


def fold(text: str) -> str:
    """``text`` with diacritics folded (see the module's rules); itself if nothing folds."""
    if text.isascii():
        return text
    return _fold(text, text.encode("utf-8", "surrogatepass"))


def _fold(text: str, data: bytes) -> str:
    """:func:`fold` of a non-ASCII ``text`` whose UTF-8 is ``data``: a byte-table pass
    finds most text has nothing to fold (curly quotes, dashes, CJK), then the regex."""
    if not data.translate(None, _NOT_FOLDABLE):
        return text
    return _FOLDABLE.sub(_fold_run, text)


class _Letters(dict[int, str]):
    """Code point -> one character: the first of its fold (ß: s), a mark itself."""

    def __missing__(self, code: int) -> str:
        folded = _FOLDS[code]
        letter = folded[0] if folded else chr(code)
        if len(self) < _CACHE_LIMIT:
            self[code] = letter
        return letter


_LETTERS = _Letters()


def _letters_run(match: re.Match[str]) -> str:
    return match.group().translate(_LETTERS)


def fold_letters(text: str) -> str:
    """:func:`fold` letter for letter, keeping the length (offsets into it are offsets
    into ``text``): for finding where a folded query term occurs."""
    if text.isascii():
        return text
    return _NON_ASCII.sub(_letters_run, text)


# A first group of 1-3 digits, then groups of 3 after one separator, the same each time;
# not preceded by a digit (or a digit and a separator), not followed by a digit or by a
# separator and a digit.
_GROUPED = re.compile(
    r"(?<!\d)(?<!\d[, \u00a0\u202f\u2009])(\d{1,3})([, \u00a0\u202f\u2009])\d{3}(?:\2\d{3})*"
    r"(?!\d)(?![, \u00a0\u202f\u2009]\d)"
)


def _merged(match: re.Match[str]) -> str:
    return match.group().replace(match.group(2), "")


# Digits to "0", ASCII separators to ",": a text whose UTF-8 so translated lacks "0,000"
# has no number grouped by "," or " " (multi-byte characters hold no ASCII byte).
_DIGITS = bytes.maketrans(b"0123456789 ", b"0000000000,")
_WIDE_SPACES = ("\u00a0", "\u202f", "\u2009")


def _ungrouped(text: str, data: bytes) -> tuple[str, list[str]]:
    """``text`` (UTF-8: ``data``) with grouped numbers merged, and the merged numbers as
    written. The regular expression runs only where the byte-table pass finds a digit,
    a separator and three digits (or a text holds a wide space): most text has none."""
    if b"0,000" not in data.translate(_DIGITS) and (
        text.isascii() or not any(space in text for space in _WIDE_SPACES)
    ):
        return text, []
    found = [m.group() for m in _GROUPED.finditer(text)]
    if not found:
        return text, found
    return _GROUPED.sub(_merged, text), found


def index_form(text: str) -> str:
    """What the full-text index is given for ``text`` (both backends, appends and reindex)."""
    data = text.encode("utf-8", "surrogatepass")
    if not text.isascii():
        text = _fold(text, data)  # (ASCII and the wide spaces unchanged: data still holds)
    text, merged = _ungrouped(text, data)
    if not merged:
        return text
    # The parts, once each: a query for "345" still finds "12,345".
    parts = dict.fromkeys(re.findall(r"\d+", " ".join(merged)))
    return text + "\n" + " ".join(parts)


def query_form(query: str) -> str:
    """A query in the form the index holds (matched term by term as before)."""
    data = query.encode("utf-8", "surrogatepass")
    if not query.isascii():
        query = _fold(query, data)
    return _ungrouped(query, data)[0]
