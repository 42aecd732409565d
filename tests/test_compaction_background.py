"""Prose topics against the conversation's background (torpor.compaction.background)."""

from __future__ import annotations

import math

import msgspec
import pytest

from torpor.compaction.background import (
    BACKGROUND_MIN_EVENTS,
    BACKGROUND_WORDS,
    grow,
    salience,
    word_counts,
)
from torpor.compaction.markers import (
    PROSE_SAMPLE,
    PROSE_WEIGHT,
    encode_hints,
    make_marker,
    prose_read,
    span_hints,
)
from torpor.errors import InvalidInput
from torpor.events import Event, UserMessage
from torpor.store.admit import check_checkpoint
from torpor.store.protocol import Background, Checkpoint

_SUBJECTS = ("scheduler", "autoscaler", "ingress", "volumes", "logging", "metrics", "quotas")


def _events(texts: list[str], start: int = 0, hints: bool = True) -> list[Event]:
    out = []
    for i, text in enumerate(texts, start):
        body = UserMessage(text)
        out.append(Event("c", i, i, 5, i, body, hints=encode_hints(body) if hints else None))
    return out


def _background(events: list[Event]) -> Background:
    return grow(None, word_counts(span_hints(events), PROSE_WEIGHT), prose_read(len(events)))


def _chat(n: int) -> list[str]:
    return [f"the kubernetes {_SUBJECTS[i % len(_SUBJECTS)]} again" for i in range(n)]


CERTS = [
    "the kubernetes certificates expired, renew the certificates",
    "kubernetes certificates rotation failed for the webhook certificates",
    "kubernetes certificates are valid now",
]


def test_a_word_every_event_uses_is_background_and_the_spans_own_word_is_its_topic() -> None:
    before = _events(_chat(40))
    span = _events(CERTS, start=40)
    background = _background(before)
    assert background.events == 40 and background.words[0] == "kubernetes"
    topics = make_marker(span, 8, span_hints(span), background).topics
    assert "certificates" in topics and "kubernetes" not in topics
    # Against common English alone (no background), the conversation's word is a topic:
    # the background is what takes it out.
    assert "kubernetes" in make_marker(span, 8, span_hints(span)).topics


def test_a_short_conversation_is_ranked_against_common_english_alone() -> None:
    small = _background(_events(_chat(BACKGROUND_MIN_EVENTS - 1)))
    assert salience({"kubernetes": 3}, 3, small) is None
    span = _events(CERTS, start=40)
    assert make_marker(span, 8, span_hints(span), small).topics == make_marker(span).topics


def test_tf_times_idf_prefers_the_span_word_rare_in_the_conversation() -> None:
    background = Background(events=100, words=("deploy", "pods"), counts=(40, 5))
    scores = salience({"deploy": 3, "pods": 3, "tls": 1}, 3, background)
    assert scores is not None
    assert scores["pods"] > scores["deploy"] > 0 and scores["tls"] > 0
    busy = Background(events=100, words=("deploy",), counts=(60,))
    assert salience({"deploy": 3, "tls": 1}, 3, busy) == {"tls": pytest.approx(math.log(104 / 2))}


def test_the_background_stays_bounded_and_is_a_function_of_the_log() -> None:
    first = grow(None, {f"word{i:04d}x": 1 for i in range(3 * BACKGROUND_WORDS)}, 10)
    assert len(first.words) == BACKGROUND_WORDS == len(first.counts)
    second = grow(first, {"word0000x": 5, "fresh": 9}, 4)
    assert second.events == 14 and second.words[:2] == ("fresh", "word0000x")
    assert second.counts[:2] == (9, 6) and len(second.words) == BACKGROUND_WORDS
    assert grow(first, {"word0000x": 5, "fresh": 9}, 4) == second


def test_a_long_span_counts_the_events_whose_words_were_read() -> None:
    long = _events(_chat(3 * PROSE_SAMPLE))
    background = _background(long)
    assert background.events == prose_read(len(long)) == PROSE_SAMPLE
    assert dict(zip(background.words, background.counts, strict=True))["kubernetes"] == PROSE_SAMPLE


def test_hints_of_old_rows_still_decode_and_fold_against_the_background() -> None:
    background = _background(_events(_chat(40)))
    fresh = _events(CERTS, start=40)
    unstored = _events(CERTS, start=40, hints=False)
    format1 = [msgspec.structs.replace(e, hints=bytes([1])) for e in unstored]
    want = make_marker(fresh, 8, span_hints(fresh), background).topics
    for events in (unstored, format1):
        assert make_marker(events, 8, span_hints(events), background).topics == want


def test_a_checkpoint_keeps_its_background_through_the_codec_and_admission() -> None:
    background = _background(_events(_chat(20)))
    checkpoint = Checkpoint("c", 20, 1, 1, background=background)
    data = msgspec.msgpack.encode(checkpoint)
    assert msgspec.msgpack.decode(data, type=Checkpoint).background == background
    old = msgspec.msgpack.encode(Checkpoint("c", 20, 1, 1))
    assert msgspec.msgpack.decode(old, type=Checkpoint).background is None
    assert check_checkpoint(checkpoint) is checkpoint
    bad = Checkpoint("c", 20, 1, 1, background=Background(3, ("a", "b"), (1,)))
    with pytest.raises(InvalidInput, match="background"):
        check_checkpoint(bad)


def test_the_audits_topic_label_stands_out_from_the_background_too() -> None:
    from torpor.compaction.anatomy import topic_label

    background = _background(_events(_chat(40)))
    turn = _events(["the kubernetes certificates expired, renew the kubernetes certificates"])
    assert topic_label(turn) == "kubernetes"  # against common English alone
    assert topic_label(turn, background) == "certificates"
