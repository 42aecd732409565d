"""SSE cursors: ids that resume a stream exactly, draft offsets and the catch-up delta."""

from __future__ import annotations

import pytest

from torpor.actors.stream import Subscriber, TurnDelta
from torpor.errors import InvalidInput
from torpor.events import Aborted, AssistantMessage, Event, UserMessage
from torpor.llm.protocol import TextDelta
from torpor.serve.sse import Cursor, Framer, format_cursor, parse_cursor, utf16_length


def ev(position: int, body: object, turn: int = 1) -> Event:
    return Event("c", position, turn, 1, 0, body)  # type: ignore[arg-type]


def test_cursor_round_trip() -> None:
    assert parse_cursor("7") == Cursor(7, 0)
    assert parse_cursor("7.12") == Cursor(7, 12)
    assert parse_cursor("-1") == Cursor(-1, 0)
    assert format_cursor(7, 0) == "7"
    assert format_cursor(7, 12) == "7.12"
    for bad in ("", "x", "1.", "01", "-2", "1.-3", "1.2.3", "9" * 30):
        with pytest.raises(InvalidInput):
            parse_cursor(bad)


def frames(framer: Framer, *items: object) -> list[tuple[str, str, str]]:
    out = []
    for item in items:
        for f in framer.frames(item):  # type: ignore[arg-type]
            out.append((f.event, f.id, f.data.get("text", "")))
    return out


def test_fresh_stream_ids_count_the_draft() -> None:
    framer = Framer(Cursor(-1))
    got = frames(framer, ev(0, UserMessage("hi")), TextDelta("ab"), TextDelta("cde"),
                 ev(1, AssistantMessage("abcde")))
    assert got == [("user", "0", ""), ("delta", "0.2", "ab"), ("delta", "0.5", "cde"),
                   ("assistant", "1", "")]


def test_resume_mid_draft_drops_what_the_client_has() -> None:
    framer = Framer(parse_cursor("0.2"))
    got = frames(framer, TextDelta("abcde"), TextDelta("fg"), ev(1, AssistantMessage("abcdefg")))
    assert got == [("delta", "0.5", "cde"), ("delta", "0.7", "fg"), ("assistant", "1", "")]


def test_resume_after_the_draft_was_logged_sends_the_rest_first() -> None:
    framer = Framer(parse_cursor("0.2"))
    got = frames(framer, ev(1, AssistantMessage("abcdefg")), ev(2, UserMessage("next")))
    assert got == [("delta", "0.7", "cdefg"), ("assistant", "1", ""), ("user", "2", "")]


def test_an_abort_carries_the_rest_of_its_partial_text() -> None:
    framer = Framer(parse_cursor("0.1"))
    got = frames(framer, ev(1, Aborted("cancelled", partial_text="abc")))
    assert got == [("delta", "0.3", "bc"), ("aborted", "1", "")]


def test_a_message_logged_mid_draft_keeps_the_draft_offset() -> None:
    # A user message sent while the answer streams: its id says how much of the draft
    # the client holds, so resuming from it neither repeats "ab" nor loses "cd".
    framer = Framer(Cursor(0))
    got = frames(framer, TextDelta("ab"), ev(1, UserMessage("meanwhile"), turn=2))
    assert got[-1] == ("user", "1.2", "")
    resumed = Framer(parse_cursor("1.2"))
    again = frames(resumed, TextDelta("abcd"), ev(2, AssistantMessage("abcd")))
    assert again == [("delta", "1.4", "cd"), ("assistant", "2", "")]


def test_no_catch_up_for_a_message_the_client_never_saw_start() -> None:
    framer = Framer(Cursor(0))
    assert frames(framer, ev(1, AssistantMessage("whole"))) == [("assistant", "1", "")]


def deltas(framer: Framer, *items: object) -> list[dict[str, object]]:
    return [f.data for item in items for f in framer.frames(item)  # type: ignore[arg-type]
            if f.event == "delta"]


def test_a_turns_stream_sends_its_turn_only_with_the_ids_of_the_whole_stream() -> None:
    # Turn 2's message is logged while turn 1's answer streams; turn 2 then answers.
    items = [ev(0, UserMessage("one")), TurnDelta("ab", 1), ev(1, UserMessage("two"), turn=2),
             TurnDelta("cd", 1), ev(2, AssistantMessage("abcd")), TurnDelta("xy", 2),
             ev(3, AssistantMessage("xy"), turn=2)]
    whole = Framer(Cursor(-1))
    everything = [(f.event, f.id, f.data.get("turn")) for i in items for f in whole.frames(i)]
    assert [t for _, _, t in everything] == [1, 1, 2, 1, 1, 2, 2]
    turn2 = Framer(Cursor(-1), turn=2)
    got = [(f.event, f.id, f.data.get("turn")) for i in items for f in turn2.frames(i)]
    assert got == [("user", "1.2", 2), ("delta", "2.2", 2), ("assistant", "3", 2)]
    assert set(got) <= set(everything)  # an id means the same in both streams


def test_a_turns_stream_resumed_from_another_turns_draft_skips_that_draft() -> None:
    # "1.2" came from the whole stream: two characters of turn 1's draft held.
    framer = Framer(parse_cursor("1.2"), turn=2)
    got = frames(framer, TurnDelta("abcd", 1), ev(2, AssistantMessage("abcd")),
                 TurnDelta("xy", 2), ev(3, AssistantMessage("xy"), turn=2))
    assert got == [("delta", "2.2", "xy"), ("assistant", "3", "")]


def test_offset16_counts_utf16_units_across_a_resume() -> None:
    framer = Framer(parse_cursor("0.2"))  # "a👋" held: two code points, three UTF-16 units
    got = deltas(framer, TurnDelta("a👋b🇫🇷", 1), TurnDelta("é", 1))
    assert [(d["text"], d["offset"], d["offset16"]) for d in got] == [
        ("b🇫🇷", 2, 3), ("é", 5, 8)]
    resumed = Framer(parse_cursor("0.3"))  # the draft was logged: the rest in one delta
    [rest] = deltas(resumed, ev(1, AssistantMessage("a👋b🇫🇷e\u0301")))
    assert (rest["text"], rest["offset"], rest["offset16"]) == ("🇫🇷e\u0301", 3, 4)
    assert utf16_length("👨‍👩‍👧") == 8 and utf16_length("abc") == 3


def test_a_slow_readers_buffer_joins_text_of_one_turn_only() -> None:
    sub = Subscriber()
    for item in (TurnDelta("a", 1), TurnDelta("b", 1), TurnDelta("c", 2), TurnDelta("d", 2)):
        sub.push(item)
    assert [sub.take(), sub.take(), sub.take()] == [TurnDelta("ab", 1), TurnDelta("cd", 2), None]
