"""The per-append fast paths give what the general paths give, for any text.

Token counting calls tiktoken's core directly and encodes a text of ASCII letters
as one piece; these tests compare with ``Encoding.encode_ordinary`` itself. Hint
extraction skips the scan for exact strings in plain lowercase prose; these tests
compare with the general scan (``_scanned``) and the bytes it encodes to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from torpor.compaction import markers, tokens
from torpor.compaction.markers import (
    HINTS_FORMAT,
    HINTS_PER_EVENT,
    SCAN_CHARS,
    WORDS_PER_EVENT,
    encode_hints,
)
from torpor.compaction.tokens import (
    MESSAGE_OVERHEAD,
    get_encoding,
    make_token_counter,
    rendered_text,
)
from torpor.errors import InvalidInput
from torpor.events import AssistantMessage, Body, ToolCall, ToolResult, UserMessage
from torpor.store import admit
from torpor.store.admit import check_body
from torpor.store.arguments import (
    POSITION_LIMIT,
    check_conversation_id,
    check_int,
    check_key,
    check_turn,
)
from torpor.store.prepare import AppendPolicy

_ENC = get_encoding()
_COUNT = make_token_counter()

# Texts near the fast paths' edges: letters alone (one piece), letters with an apostrophe,
# digits, spaces and newlines (other pieces), non-ASCII letters (not ASCII), and anything.
_LETTERS = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
_NEAR = st.text(st.sampled_from("abcXYZ '0\n\t.:éß_-\u00a0"), max_size=40)
# ASCII text, split by the counter itself under cl100k: every character class its pattern
# tells apart, contractions, the white space Python's \s takes and Unicode's does not.
_ASCII = st.text(st.characters(max_codepoint=127), max_size=80)
_ASCII_EDGES = st.text(
    st.sampled_from("aZ09 '\t\n\x0b\x0c\r\x1c\x1f.,!-_`sSdtlLvVeErRmM"), max_size=40
)
_TEXTS = st.one_of(_LETTERS, _NEAR, _ASCII, _ASCII_EDGES, st.text(max_size=60))


def _expected(body: Body) -> int:
    text = rendered_text(body)
    if text is None:
        return 0
    return len(_ENC.encode_ordinary(text)) + MESSAGE_OVERHEAD


@settings(max_examples=400, deadline=None)
@given(_TEXTS)
def test_the_counter_counts_what_encode_ordinary_counts(text: str) -> None:
    assert _COUNT(UserMessage(text)) == _expected(UserMessage(text))
    assert _COUNT(AssistantMessage(text)) == _expected(AssistantMessage(text))
    body = ToolResult("c1", "grep", text)
    assert _COUNT(body) == _expected(body)


def test_words_in_and_out_of_the_vocabulary_count_as_the_encoder_counts_them() -> None:
    for word in ("ping", "Hello", "a", "Z", "antidisestablishmentarianism", "qxzvbnmw" * 40):
        assert _COUNT(UserMessage(word)) == len(_ENC.encode_ordinary(word)) + MESSAGE_OVERHEAD
    assert _COUNT(UserMessage("ping")) == 1 + MESSAGE_OVERHEAD


def test_ascii_edges_count_as_the_encoder_counts_them() -> None:
    for text in (
        "echo: ping", "don't", "I'LL", "'s", "''s", "a  b", "a \n b", "x\r\n", "  \n\n ",
        "123456", " 1", "1 ", "  !!", "\t\t", "end.  ", "\x0b\x0c", "a\x1cb", "foo\n", "\n",
        "tab\tsep", "~!@#$%^&*()", "a" * 500 + "!", "deploy.py timed out after 30s on db-7",
    ):
        assert _COUNT(UserMessage(text)) == len(_ENC.encode_ordinary(text)) + MESSAGE_OVERHEAD


def _toy_encoding(pattern: str) -> tiktoken.Encoding:
    """An encoding built here (no download): every byte, and a few merges, under ``pattern``."""
    ranks = {bytes([b]): b for b in range(256)}
    for word in (b"pi", b"pin", b"ping", b"oW", b"He", b"Hel", b"Hell", b"Hello", b" p", b"'s"):
        ranks[word] = len(ranks)
    return tiktoken.Encoding("toy", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


@settings(max_examples=300, deadline=None)
@given(st.one_of(_LETTERS, _ASCII_EDGES, st.sampled_from(["ping", "HelloWorld", "oW", "pIng"])))
def test_letters_are_one_piece_only_under_the_patterns_listed(text: str) -> None:
    # r50k's pattern (gpt2, p50k) keeps letters as one piece; o200k's, not listed, does not
    # ("oW" is two pieces, one token as one), so its counter must not take the one-piece path.
    r50k = tokens._R50K_PATTERN
    o200k = "|".join(
        [
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    )
    for pattern in (r50k, o200k):
        toy = _toy_encoding(pattern)
        assert tokens._length(toy)(text) == len(toy.encode_ordinary(text))


def test_a_lone_surrogate_is_counted_as_the_encoder_repairs_it() -> None:
    text = "ab\ud800cd"  # the core refuses it; Encoding.encode_ordinary repairs and counts
    assert _COUNT(UserMessage(text)) == len(_ENC.encode_ordinary(text)) + MESSAGE_OVERHEAD


def test_tool_calls_and_empty_text_take_the_general_path() -> None:
    calls = (ToolCall("c1", "search", {"q": "ping"}),)
    for body in (AssistantMessage("", calls), AssistantMessage("see", calls), UserMessage("")):
        assert _COUNT(body) == _expected(body)


def _scanned_bytes(text: str) -> bytes:
    """What encode_hints stored for ``text`` before the fast path: the general scan, encoded."""
    if not text:
        return bytes([HINTS_FORMAT])
    exact, prose = markers._scanned(text[:SCAN_CHARS], HINTS_PER_EVENT, WORDS_PER_EVENT)
    head = msgspec.msgpack.encode(exact) if exact else b""
    tail = msgspec.msgpack.encode(prose) if prose else b""
    if not head and not tail:
        return bytes([HINTS_FORMAT])
    return bytes([HINTS_FORMAT]) + len(head).to_bytes(2, "big") + head + tail


# Plain lowercase prose, built to match markers._PLAIN: common and uncommon words, short
# and long, repeated, between the separators it allows ("." and ":" before whitespace).
_WORD = st.one_of(
    st.sampled_from(["that", "this", "with", "ping", "echo", "deploy", "canary", "ok", "a"]),
    st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz"), min_size=1, max_size=12),
)
_SEPARATOR = st.sampled_from([" ", "  ", "\n", ", ", ",", ";", "!", "? ", ". ", ": ", ".\n", ":\n"])
_PLAIN_TEXT = st.builds(
    lambda parts, end: "".join(parts) + end,
    st.lists(st.one_of(_WORD, _SEPARATOR), max_size=30),
    st.sampled_from(["", ".", ":", "!", "\n"]),
)
# One character away from plain prose: capitals, digits, marks that begin exact strings,
# "." or ":" before a letter, other whitespace; the fast path must decline these.
# Sentences: capitals, apostrophes, after every separator (some plain, some not: ", Bob").
_SENTENCE = st.builds(
    "".join,
    st.lists(
        st.one_of(
            st.sampled_from(["Hello", "I", "I'm", "don't", "Thanks", "Bob", "The", "camelCase"]),
            _WORD,
            _SEPARATOR,
            st.sampled_from(["'", "  ", ", ", "; "]),
        ),
        max_size=20,
    ),
)
_NEAR_PLAIN = st.one_of(
    _SENTENCE,
    st.text(st.sampled_from("abpy .:,;!?\n'AIH"), max_size=30),
    st.text(st.sampled_from("abcdefpq .:,;!?\nA0_-/=~`\"'@#\t\x0b\x1c()é"), max_size=40),
)


@settings(max_examples=500, deadline=None)
@given(_PLAIN_TEXT)
def test_plain_prose_takes_the_fast_path_and_gets_the_general_result(text: str) -> None:
    assert markers._PLAIN.match(text) is not None
    for words in (0, 1, WORDS_PER_EVENT):
        assert markers._candidates(text, HINTS_PER_EVENT, words) == markers._scanned(
            text, HINTS_PER_EVENT, words
        )
    assert encode_hints(UserMessage(text)) == _scanned_bytes(text)


@settings(max_examples=500, deadline=None)
@given(st.one_of(_NEAR_PLAIN, st.text(max_size=80)))
def test_any_text_gets_the_general_result(text: str) -> None:
    assert markers._candidates(text, HINTS_PER_EVENT, WORDS_PER_EVENT) == markers._scanned(
        text, HINTS_PER_EVENT, WORDS_PER_EVENT
    )
    assert encode_hints(UserMessage(text)) == _scanned_bytes(text)
    assert encode_hints(AssistantMessage(text)) == _scanned_bytes(text)


def test_the_fast_path_declines_what_could_hold_an_exact_string() -> None:
    for text in (
        "see file.py", "echo:ping", "host db7", "it is a_b", "x=1", "end..", "Hi, Bob",
        "ask Alice", "an iPhone", "the AWS bill", "say \"hi there\"", "`code`", "a/b",
    ):
        assert markers._PLAIN.match(text) is None, text


def test_everyday_sentences_take_the_fast_path_with_the_general_result() -> None:
    for text in (
        "Hello, how are you today?",
        "Hi! Can you help me with my resume? I'm applying for jobs.",
        "Thanks, that's great.\nSee you tomorrow.",
        "Ping",
    ):
        assert markers._PLAIN.match(text) is not None, text
        assert encode_hints(UserMessage(text)) == _scanned_bytes(text)


def test_a_plain_text_longer_than_the_scan_is_cut_where_the_scan_cuts_it() -> None:
    # The word across SCAN_CHARS is cut: both paths must see the same first part of it.
    text = "word " * (SCAN_CHARS // 5) + "zebrafish " * 20
    assert len(text) > SCAN_CHARS
    assert encode_hints(UserMessage(text)) == _scanned_bytes(text)
    assert markers._candidates(text, HINTS_PER_EVENT, WORDS_PER_EVENT) == markers._scanned(
        text[:SCAN_CHARS], HINTS_PER_EVENT, WORDS_PER_EVENT
    )
    single = "q" * (SCAN_CHARS + 10)  # one word past the scan: the fast path's one-word case
    assert encode_hints(UserMessage(single)) == _scanned_bytes(single)


class _Text(str):
    """A str subclass: check_text takes it, the fast path leaves it to the general one."""


_ANY_TEXT = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["", "ping", "a\x00b", "\x00", "a\ud800b", "\udfff", "é", _Text("sub")]),
    st.sampled_from([5, None, b"bytes", 1.5]),
)
_CALLS = st.sampled_from([(), [], None, "calls", (ToolCall("c1", "t"),), (ToolCall("", "t"),)])


def _outcome(check: Callable[[Body, str], None], body: Body) -> tuple[str, str] | None:
    try:
        check(body, "events[3]")
    except InvalidInput as exc:
        return exc.what, str(exc)
    return None


@settings(max_examples=400, deadline=None)
@given(
    _ANY_TEXT,
    _CALLS,
    st.sampled_from([None, "art-1", "", 5]),
    st.sampled_from([None, 10, -1, True]),
)
def test_check_body_refuses_what_its_general_path_refuses(
    text: Any, calls: Any, artifact: Any, full_size: Any
) -> None:
    bodies: list[Any] = [
        UserMessage(text),
        AssistantMessage(text),
        AssistantMessage(text, calls, artifact, full_size),
        AssistantMessage("fine", calls),
    ]
    for body in bodies:
        assert _outcome(check_body, body) == _outcome(admit._check_any, body)


_IDS = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["c", "x" * 256, "x" * 257, "a\x00", "a\ud800", "é", _Text("sub"), 5, None]),
)
_INTS = st.one_of(
    st.sampled_from([0, -1, -2, 2**31 - 1, 2**31, 2**32 - 1, 2**32, True, None, 1.0, "3"]),
    st.integers(),
)


def _named_checks(conversation_id: Any, turn: Any, expect_head: Any, key: Any) -> None:
    """What prepare checked before its inline tests: the named checks, in its order."""
    check_conversation_id(conversation_id)
    check_turn(turn)
    if expect_head is not None:
        check_int(expect_head, "expect_head", -1, POSITION_LIMIT)
    check_key(key)


@settings(max_examples=400, deadline=None)
@given(_IDS, _INTS, _INTS, st.one_of(st.none(), _IDS))
def test_prepare_refuses_the_arguments_the_named_checks_refuse(
    conversation_id: Any, turn: Any, expect_head: Any, key: Any
) -> None:
    policy = AppendPolicy()
    try:
        _named_checks(conversation_id, turn, expect_head, key)
        expected = None
    except InvalidInput as exc:
        expected = (exc.what, str(exc))
    try:
        policy.prepare(
            conversation_id, [UserMessage("hi")], turn=turn, expect_head=expect_head, key=key
        )
        got = None
    except InvalidInput as exc:
        got = (exc.what, str(exc))
    assert got == expected
