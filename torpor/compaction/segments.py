"""Where a long text can be cut so that each part is encoded alone, with bounded work.

tiktoken splits a text into pieces with its pattern and byte-pair encodes each
piece; the cost of one piece grows faster than its length (about 40 ns a byte
at 1 KB, 250 ns at 1 MB), and a text without spaces can be one piece of a
megabyte. Counting a long text in segments of a few thousand characters keeps
every piece, and so the work per byte, bounded.

A cut is *safe* when the pieces of the two parts are exactly the pieces of the
whole, so the count of the parts adds up to the count of the whole. Under the
cl100k and r50k patterns (the ones :data:`SAFE_PATTERNS` lists, checked by the
tests against ``Encoding.encode_ordinary``) these cuts are safe:

* before a space that has a non-space on each side: no piece holds a space
  after a non-space, so a piece starts there, and no match before it looks past
  it in a way that a space and the end of the text would answer differently;
* between an ASCII letter and an ASCII digit, either way round: letters and
  digits are never in one piece, and neither takes the other as its prefix.

A stretch with neither (letters alone, punctuation alone or white space alone,
longer than a segment) is cut anywhere: its one long piece becomes several, and
the count is then an estimate, a few tokens more than the exact one per cut
(well under 0.1% of a text of letters cut every 4,096 characters).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

__all__ = ["SEGMENT", "cut_points"]

SEGMENT = 4096
"""Characters a segment holds at least (at most twice as many): the pieces of a text
cut this way are at most that long, and each costs at most ~100 ns a byte to encode."""

_CLASS_CHANGE = re.compile(r"[A-Za-z][0-9]|[0-9][A-Za-z]")
_LOOK = 256
"""Characters searched for a letter-digit change (a regex step per character, unlike the
search for a space): text that mixes letters and digits (ids, hex, base64) has one within
a few characters, and a stretch of letters alone is not scanned end to end."""


def cut_points(text: str, size: int = SEGMENT) -> Iterator[int]:
    """Positions at which to cut ``text`` into parts of ``size`` to ``2 * size`` characters,
    in order (lazily: a caller that needs only the first parts finds only their cuts).

    Safe cuts (see the module) are taken where there is one in a part's second
    half; elsewhere the cut falls at ``size`` (an estimate). None for a text of at
    most ``2 * size`` characters.
    """
    n = len(text)
    start = 0
    while n - start > 2 * size:
        start = _cut(text, start + size, start + 2 * size)
        yield start


def _cut(text: str, at: int, end: int) -> int:
    """A safe cut in ``[at, end)``, else ``at`` (``0 < at`` and ``end < len(text)``)."""
    find = text.find
    space = find(" ", at, end)
    while space != -1:
        if not text[space - 1].isspace() and not text[space + 1].isspace():
            # str.isspace takes every character of Unicode's White_Space (the pattern's
            # \s) and a few more (\x1c-\x1f): a cut it declines is only a cut not taken.
            return space
        space = find(" ", space + 1, end)
    change = _CLASS_CHANGE.search(text, at - 1, min(end, at + _LOOK))
    if change is not None:
        return change.start() + 1
    return at
