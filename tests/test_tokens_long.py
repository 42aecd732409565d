"""Issue 19, item 3: long texts are counted in segments, with bounded work per piece.

A text over ``LONG_TEXT`` characters goes to tiktoken's core in segments cut
where the pattern's pieces surely break (before a space between two
non-spaces, between an ASCII letter and digit): the count is then exact. A
stretch with no such place (letters alone) is cut anyway, and its count is a
close estimate. Checked against ``Encoding.encode_ordinary`` itself.
"""

from __future__ import annotations

import random
import string
from itertools import pairwise
from typing import Any

import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from torpor.compaction import tokens
from torpor.compaction.segments import SEGMENT, cut_points
from torpor.compaction.slots import clip_text
from torpor.compaction.tokens import (
    DEFAULT_ENCODING,
    LONG_TEXT,
    get_encoding,
    leading_text,
    make_token_counter,
)
from torpor.events import UserMessage

_ENC = get_encoding()
_LENGTH = tokens._length(_ENC)


def _exact(text: str) -> int:
    return len(_ENC.encode_ordinary(text))


def _safe(text: str, p: int) -> bool:
    """The cuts segments.py calls safe, written out from its docstring."""
    before, after = text[p - 1], text[p]
    if after == " " and p + 1 < len(text):
        return not before.isspace() and not text[p + 1].isspace()
    letters, digits = string.ascii_letters, string.digits
    return (before in letters and after in digits) or (before in digits and after in letters)


# Every character class the patterns tell apart, contractions, several kinds of white space
# (Unicode's and not), non-ASCII letters and marks, digits beside letters.
_PARTS = st.sampled_from(
    ["a", "Z", "é", "ß", "字", "0", "7", " ", "  ", "\n", "\t", "\r\n", "'s", "'LL", "!", ".",
     "-", "\u00a0", "\x1c", "\u0301", "😀", "x1", "9b", " 12", "ab", "don't", "?!"]
)
_TEXT = st.lists(_PARTS, min_size=2, max_size=40).map("".join)


@settings(max_examples=400, deadline=None)
@given(_TEXT)
def test_a_safe_cut_keeps_the_count_of_the_whole(text: str) -> None:
    for toy in (None, _toy(tokens._R50K_PATTERN)):
        encode = _ENC.encode_ordinary if toy is None else toy.encode_ordinary
        whole = len(encode(text))
        for p in range(1, len(text)):
            if _safe(text, p):
                assert len(encode(text[:p])) + len(encode(text[p:])) == whole, (text, p)


def _toy(pattern: str) -> tiktoken.Encoding:
    ranks = {bytes([b]): b for b in range(256)}
    for word in (b"ab", b"abc", b" a", b"'s", b"12", b"  ", b"\n\n"):
        ranks[word] = len(ranks)
    return tiktoken.Encoding("toy", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


@settings(max_examples=200, deadline=None)
@given(_TEXT, st.integers(1, 6))
def test_cut_points_cut_into_parts_of_size_to_twice_size(text: str, size: int) -> None:
    cuts = list(cut_points(text, size))
    bounds = [0, *cuts, len(text)]
    parts = [b - a for a, b in pairwise(bounds)]
    assert all(size <= n <= 2 * size for n in parts[:-1]) and parts[-1] <= 2 * size
    for a, cut in zip(bounds, cuts, strict=False):  # safe where the window had a safe place
        window = range(a + size, a + 2 * size)
        if any(_safe(text, p) for p in window if p < len(text)):
            assert _safe(text, cut)


def _natural(size: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["the", "build", "don't", "Zürich", "naïve", "字字", "x86_64", "v1.2.3", "ok!",
             "\n", "\n\n", "  ", "tab\there", "12345", "URL:https://example.org/a?b=c"]
    return " ".join(rng.choice(words) for _ in range(size // 5))[:size]


def test_a_long_natural_text_is_counted_exactly() -> None:
    for seed in range(3):
        text = _natural(60_000, seed)
        assert len(text) > LONG_TEXT
        assert _LENGTH(text) == _exact(text)
    # identifiers, hex and base64 without spaces: cut between letters and digits, exact
    rng = random.Random(5)
    alnum = "".join(rng.choices(string.ascii_letters + string.digits, k=50_000))
    hexed = rng.randbytes(25_000).hex()
    for text in (alnum, hexed):
        assert _LENGTH(text) == _exact(text)


def test_a_text_of_letters_alone_is_estimated_within_a_small_tolerance() -> None:
    rng = random.Random(19)
    sample = "".join(rng.choices(string.ascii_letters, k=300_000))
    exact = _exact(sample)
    counted = _LENGTH(sample)
    assert counted >= exact and counted - exact <= exact * 0.0005  # a token or so per cut
    # a megabyte: the same tokens per character as the sample's exact count, within 0.5%
    big = "".join(rng.choices(string.ascii_letters, k=1_000_000))
    per_char = _LENGTH(big) / len(big)
    assert abs(per_char - exact / len(sample)) <= 0.005 * exact / len(sample)
    assert make_token_counter()(UserMessage(big)) == _LENGTH(big) + tokens.MESSAGE_OVERHEAD


class _Core:
    """tiktoken's core, recording the longest text or piece handed to it in one call."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self.longest = 0

    def encode_ordinary(self, text: str) -> Any:
        self.longest = max(self.longest, len(text))
        return self._core.encode_ordinary(text)

    def encode_single_piece(self, piece: bytes) -> Any:
        self.longest = max(self.longest, len(piece))
        return self._core.encode_single_piece(piece)


class _Watched:
    """An encoding (what :func:`tokens._length` reads of one) over a recording core."""

    def __init__(self, enc: tiktoken.Encoding) -> None:
        self._pat_str = enc._pat_str
        self._mergeable_ranks = enc._mergeable_ranks
        self.encode_ordinary = enc.encode_ordinary
        self._core_bpe = _Core(enc._core_bpe)


def test_no_call_into_the_core_gets_more_than_two_segments() -> None:
    watched = _Watched(_ENC)
    length = tokens._length(watched)  # type: ignore[arg-type]
    rng = random.Random(3)
    for text in ("".join(rng.choices(string.ascii_letters, k=100_000)), "!" * 50_000,
                 "é" * 40_000, _natural(100_000, 1)):
        watched._core_bpe.longest = 0
        assert length(text) > 0
        assert 0 < watched._core_bpe.longest <= 2 * SEGMENT


def test_leading_text_is_the_text_of_the_first_tokens() -> None:
    # short, and long with safe cuts: exactly what decoding the first tokens gives
    for text in ("hello there, general", _natural(50_000, 2)):
        for keep in (1, 3, 1000, 5000):
            expected = _ENC.decode(_ENC.encode_ordinary(text)[:keep])
            assert leading_text(text, keep, DEFAULT_ENCODING) == expected
        assert leading_text(text, 10**9, DEFAULT_ENCODING) == text
    # letters alone (cut anywhere): a prefix, within the tokens kept, no more than one short
    rng = random.Random(7)
    letters = "".join(rng.choices(string.ascii_letters, k=400_000))
    for keep in (10, 20_000, 100_000):
        kept = leading_text(letters, keep, DEFAULT_ENCODING)
        assert letters.startswith(kept)
        assert keep - 2 <= _exact(kept) <= keep


class _Counting:
    """An encoding (what :func:`leading_text` reads of one) counting the characters it
    is asked to encode."""

    def __init__(self, enc: tiktoken.Encoding) -> None:
        self._enc = enc
        self._pat_str = enc._pat_str
        self.decode = enc.decode
        self.encoded = 0

    def encode_ordinary(self, text: str) -> list[int]:
        self.encoded += len(text)
        return self._enc.encode_ordinary(text)


def test_leading_text_encodes_no_further_than_what_it_keeps() -> None:
    counting = _Counting(_ENC)
    tokens._encodings["counting-test"] = counting  # type: ignore[assignment]
    try:
        letters = "".join(random.Random(8).choices(string.ascii_letters, k=1_000_000))
        kept = leading_text(letters, 1000, "counting-test")
        assert _exact(kept) <= 1000 and letters.startswith(kept)
        assert counting.encoded <= 2 * SEGMENT  # the first segment holds 1,000 tokens
        counting.encoded = 0
        assert clip_text(letters, 30_000, "counting-test") == leading_text(
            letters[:240_000], 30_000, "counting-test"
        )
        assert counting.encoded <= 2 * (30_000 * 2 + 2 * SEGMENT)  # ~1.5 letters a token
    finally:
        del tokens._encodings["counting-test"]


def test_clip_text_keeps_what_it_kept_before_on_ordinary_text() -> None:
    text = _natural(200_000, 4)
    for keep in (10, 4000, 20_000):
        prefix = text[: keep * 8]
        tokens_ = _ENC.encode_ordinary(prefix)
        before = prefix if len(tokens_) <= keep else _ENC.decode(tokens_[:keep], errors="replace")
        assert clip_text(text, keep, DEFAULT_ENCODING) == before
