"""The per-append fast paths give what the general paths give, for any text.

Token counting calls tiktoken's core directly and encodes a text of ASCII letters
as one piece; these tests compare with ``Encoding.encode_ordinary`` itself.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from torpor.compaction.tokens import (
    MESSAGE_OVERHEAD,
    get_encoding,
    make_token_counter,
    rendered_text,
)
from torpor.events import AssistantMessage, Body, ToolCall, ToolResult, UserMessage

_ENC = get_encoding()
_COUNT = make_token_counter()

# Texts near the fast paths' edges: letters alone (one piece), letters with an apostrophe,
# digits, spaces and newlines (other pieces), non-ASCII letters (not ASCII), and anything.
_LETTERS = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
_NEAR = st.text(st.sampled_from("abcXYZ '0\n\t.:éß_-\u00a0"), max_size=40)
_TEXTS = st.one_of(_LETTERS, _NEAR, st.text(max_size=60))


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


def test_a_lone_surrogate_is_counted_as_the_encoder_repairs_it() -> None:
    text = "ab\ud800cd"  # the core refuses it; Encoding.encode_ordinary repairs and counts
    assert _COUNT(UserMessage(text)) == len(_ENC.encode_ordinary(text)) + MESSAGE_OVERHEAD


def test_tool_calls_and_empty_text_take_the_general_path() -> None:
    calls = (ToolCall("c1", "search", {"q": "ping"}),)
    for body in (AssistantMessage("", calls), AssistantMessage("see", calls), UserMessage("")):
        assert _COUNT(body) == _expected(body)
