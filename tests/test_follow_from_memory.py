"""A follower whose cursor is among a live agent's latest events replays them from memory.

A POST that streams its own turn subscribes right after ``send`` committed the user
message: reading that message back from the log cost more than any other part of the
turn's stream. The agent keeps its latest events instead; the log is read only for a
cursor older than those (a reconnect) or an agent that is not live. Either way the
follower gets every event once, in order, and each answer's text once.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from serve_support import kinds, post_message, served, text_of

from torpor import (
    AssistantMessage,
    EchoModel,
    Event,
    Runtime,
    ScriptedModel,
    TextDelta,
    UserMessage,
)
from torpor.actors.agent import RECENT_EVENTS
from torpor.actors.stream import Follower, StreamItem
from torpor.llm import Signal, Text, Wait


def count_reads(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The positions ``store.read_since`` is called with from now on (on the instance:
    every read the runtime makes goes through ``rt.store``)."""
    calls: list[int] = []
    read_since = store.read_since

    async def counted(conversation_id: str, position: int) -> list[Event]:
        calls.append(position)
        result: list[Event] = await read_since(conversation_id, position)
        return result

    monkeypatch.setattr(store, "read_since", counted)
    return calls


async def follow_until(follower: Follower, last: int) -> list[StreamItem]:
    """What the follower yields up to the event at position ``last``."""
    items: list[StreamItem] = []
    with anyio.fail_after(10):
        async for item in follower:
            items.append(item)
            if isinstance(item, Event) and item.position == last:
                break
    return items


def positions(items: list[StreamItem]) -> list[int]:
    return [i.position for i in items if isinstance(i, Event)]


def answers_and_text(items: list[StreamItem]) -> list[tuple[str, str]]:
    """Each answer's text as logged, and the deltas streamed before it (since the last)."""
    out: list[tuple[str, str]] = []
    streamed = ""
    for item in items:
        if isinstance(item, TextDelta):
            streamed += item.text
        elif isinstance(item.body, AssistantMessage):
            out.append((item.body.text, streamed))
            streamed = ""
    return out


async def test_a_follower_of_the_turn_just_sent_reads_nothing_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with Runtime("sqlite://", model=EchoModel(chunk_size=2)) as rt:
        await (await rt.send("c", "hello")).result()  # a live agent with some history
        reads = count_reads(rt.store, monkeypatch)
        turn = await rt.send("c", "again")
        async with rt.subscribe("c", after=turn.user_position - 1) as follower:
            items = await follow_until(follower, turn.user_position + 1)
    assert reads == []
    assert positions(items) == [2, 3]
    first = items[0]
    assert isinstance(first, Event) and first.body == UserMessage("again")
    assert answers_and_text(items) == [("echo: again", "echo: again")]


async def test_a_message_logged_between_the_send_and_the_subscribe_comes_once_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first turn streams; a second message is logged (postponed) before the follower
    of the first subscribes: both messages from memory, the text in flight, then live."""
    streamed, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("Al"), Signal(streamed), Wait(go), Text("pha")], [Text("b")]])
    async with Runtime("sqlite://", model=model) as rt:
        reads = count_reads(rt.store, monkeypatch)
        first = await rt.send("c", "one")
        await streamed.wait()  # "Al" is in flight
        second = await rt.send("c", "two")  # lands between the first send and its follower
        assert second.postponed and second.user_position == first.user_position + 1
        async with rt.subscribe("c", after=first.user_position - 1) as follower:
            go.set()
            items = await follow_until(follower, 3)
    assert reads == []
    assert positions(items) == [0, 1, 2, 3]
    users = [i.body.text for i in items if isinstance(i, Event) and isinstance(i.body, UserMessage)]
    assert users == ["one", "two"]
    assert answers_and_text(items) == [("Alpha", "Alpha"), ("b", "b")]


async def test_turns_that_ended_before_the_subscribe_replay_from_memory_without_their_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with Runtime("sqlite://", model=EchoModel(chunk_size=3)) as rt:
        first = await rt.send("c", "one")
        await first.result()
        await (await rt.send("c", "two")).result()
        reads = count_reads(rt.store, monkeypatch)
        async with rt.subscribe("c", after=first.user_position - 1) as follower:
            await rt.send("c", "three")
            items = await follow_until(follower, 5)
    assert reads == []
    assert positions(items) == [0, 1, 2, 3, 4, 5]
    assert all(isinstance(i, Event) for i in items[:4])  # ended turns: their events only
    assert answers_and_text(items) == [("echo: one", ""), ("echo: two", ""),
                                       ("echo: three", "echo: three")]


async def test_a_cursor_older_than_memory_or_an_agent_not_live_reads_the_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with Runtime("sqlite://", model=EchoModel()) as rt:
        turns = RECENT_EVENTS // 2 + 1  # two events a turn: the first ones fall out of memory
        for n in range(turns):
            await (await rt.send("c", f"m{n}")).result()
        last = 2 * turns - 1
        reads = count_reads(rt.store, monkeypatch)
        async with rt.subscribe("c", after=-1) as follower:
            items = await follow_until(follower, last)
        assert reads == [0]
        assert positions(items) == list(range(last + 1))
        # a cursor memory still covers: no read
        async with rt.subscribe("c", after=last - 3) as follower:
            assert positions(await follow_until(follower, last)) == [last - 2, last - 1, last]
        assert reads == [0]
        assert await rt.admin.hibernate("c")  # its memory goes with its working set
        async with rt.subscribe("c", after=last - 1) as follower:
            assert positions(await follow_until(follower, last)) == [last]
        assert reads == [0, last]


async def test_a_post_streams_its_turn_without_reading_the_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with Runtime("sqlite://", model=EchoModel(chunk_size=4)) as rt, served(rt) as (
        _, client, _app
    ):
        reads = count_reads(rt.store, monkeypatch)
        for text in ("first", "second"):  # a new conversation: live once the send is logged
            conn, response = await post_message(client, "c", text)
            events = [e async for e in response.events()]
            await conn.close()
            assert kinds(events)[0] == "user" and kinds(events)[-1] == "assistant"
            assert text_of(events) == f"echo: {text}"
        assert reads == []
