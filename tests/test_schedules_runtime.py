"""Runtime.schedule: a conversation woken later, by the runtime's one timer.

Time is the runtime's clock (``RuntimeConfig(clock=...)``), moved by the test: nothing
here waits for wall-clock time; what fired is read from the log and the store.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import anyio
import pytest

from torpor import (
    AgentConfig,
    AgentParked,
    AssistantMessage,
    EchoModel,
    Event,
    IdempotencyConflict,
    InvalidInput,
    Runtime,
    RuntimeConfig,
    ScriptedModel,
    ToolResult,
    UnknownConversation,
    UserMessage,
)
from torpor.events import Parked
from torpor.llm.scripted import Call, Signal, Text, Wait

T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def config(clock: Clock, **kw: object) -> RuntimeConfig:
    return RuntimeConfig(clock=clock, **kw)  # type: ignore[arg-type]


async def answered(rt: Runtime, conversation: str, after: int, answers: int = 1) -> list[Event]:
    """The events logged after ``after`` until ``answers`` final answers (followed live)."""
    seen: list[Event] = []
    with anyio.fail_after(20):
        async with rt.subscribe(conversation, after=after) as follower:
            async for item in follower:
                if isinstance(item, Event):
                    seen.append(item)
                    body = item.body
                    if isinstance(body, AssistantMessage) and not body.tool_calls:
                        answers -= 1
                        if answers == 0:
                            return seen
    raise AssertionError("the follower ended")


def scheduled(events: list[Event]) -> list[str]:
    return [e.body.text for e in events
            if isinstance(e.body, UserMessage) and e.body.scheduled is not None]


async def test_schedule_list_unschedule_keys_and_bad_input(tmp_path: Path) -> None:
    clock = Clock()
    async with Runtime(f"sqlite:///{tmp_path}/s.db", config=config(clock)) as rt:
        with pytest.raises(UnknownConversation):
            await rt.schedule("c", "later", after=60)
        await (await rt.send("c", "hi")).result()
        a = await rt.schedule("c", "in a minute", after=60)
        assert a.due == int(T0 * 1000) + 60_000 and a.conversation_id == "c"
        b = await rt.schedule("c", "at noon", at=datetime(2030, 1, 1, 12, tzinfo=UTC), key="k")
        assert b.due == int(datetime(2030, 1, 1, 12, tzinfo=UTC).timestamp() * 1000)
        assert await rt.schedule("c", "at noon", at=datetime(2030, 1, 1, 12, tzinfo=UTC),
                                 key="k") == b
        with pytest.raises(IdempotencyConflict):
            await rt.schedule("c", "at one", at=datetime(2030, 1, 1, 13, tzinfo=UTC), key="k")
        for bad in ({}, {"at": 1.0, "after": 1.0}, {"after": 1, "every": 0.1},
                    {"after": -5}, {"at": datetime(2030, 1, 1)}):
            with pytest.raises(InvalidInput):
                await rt.schedule("c", "x", **bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            await rt.schedule("c", "", after=1)
        assert [s.id for s in await rt.schedules("c")] == [a.id, b.id]
        first, second = sorted([a.id, b.id])  # by id (one clock tick: random order)
        page = await rt.admin.schedules(limit=1)
        assert [s.id for s in page.schedules] == [first] and page.next == first
        rest = await rt.admin.schedules(limit=10, after=page.next)
        assert [s.id for s in rest.schedules] == [second] and rest.next is None
        assert await rt.unschedule("c", a.id) is True
        assert await rt.unschedule("c", a.id) is False
        assert [s.id for s in await rt.schedules("c")] == [b.id]


async def test_fires_and_the_agent_answers(tmp_path: Path) -> None:
    clock = Clock()
    model = EchoModel()
    async with Runtime(f"sqlite:///{tmp_path}/s.db", model=model, config=config(clock)) as rt:
        await (await rt.send("c", "hi")).result()
        head = await rt.store.head("c")
        assert head is not None
        s = await rt.schedule("c", "check the deploy", after=600)
        clock.now += 601
        rt._scheduler.poke()  # the clock moved: as the timer's own wake-up would find
        events = await answered(rt, "c", head)
        assert scheduled(events) == ["check the deploy"]
        user = events[0].body
        assert isinstance(user, UserMessage) and user.scheduled == s.id
        answer = events[-1].body
        assert isinstance(answer, AssistantMessage)
        assert "[scheduled] check the deploy" in answer.text  # the model saw the mark
        assert await rt.schedules("c") == []


async def test_an_evicted_agent_is_revived_by_its_schedule(tmp_path: Path) -> None:
    clock = Clock()
    async with Runtime(f"sqlite:///{tmp_path}/s.db", config=config(clock)) as rt:
        await (await rt.send("c", "hi")).result()
        assert await rt.admin.evict("c")
        assert "c" not in rt._registry
        head = await rt.store.head("c")
        assert head is not None
        await rt.schedule("c", "wake up", after=5)
        clock.now += 5
        rt._scheduler.poke()
        events = await answered(rt, "c", head)
        assert scheduled(events) == ["wake up"]


async def test_every_repeats_and_missed_intervals_fire_once(tmp_path: Path) -> None:
    clock = Clock()
    url = f"sqlite:///{tmp_path}/s.db"
    async with Runtime(url, config=config(clock)) as rt:
        await (await rt.send("c", "hi")).result()
        s = await rt.schedule("c", "tick", every=10)
        assert s.due == int(T0 * 1000) + 10_000 and s.every == 10.0
    # Down for 35 s: three intervals missed; it fires once, then at T0 + 40.
    clock.now += 35
    async with Runtime(url, config=config(clock)) as rt:
        head = await rt.store.head("c")
        assert head is not None
        await answered(rt, "c", head)
        [pending] = await rt.schedules("c")
        assert pending.due == int(T0 * 1000) + 40_000 and pending.fired == 1
        head = await rt.store.head("c")
        assert head is not None
        clock.now += 6
        rt._scheduler.poke()
        await answered(rt, "c", head)
        [pending] = await rt.schedules("c")
        assert pending.due == int(T0 * 1000) + 50_000 and pending.fired == 2
        log = await rt.store.read_since("c", 0)
        assert scheduled(log) == ["tick", "tick"]


async def test_set_ahead_left_and_reopened_later_fires_once_at_start(tmp_path: Path) -> None:
    """Must show: a schedule 2 s ahead, the runtime left at once and reopened 5 s later on
    the same file: the message fires once, at start-up, and is answered."""
    clock = Clock()
    url = f"sqlite:///{tmp_path}/s.db"
    async with Runtime(url, config=config(clock)) as rt:
        await (await rt.send("c", "hi")).result()
        await rt.schedule("c", "two seconds later", after=2)
        head = await rt.store.head("c")
        assert head is not None
    clock.now += 5
    async with Runtime(url, config=config(clock)) as rt:
        events = await answered(rt, "c", head)  # nobody sent anything: start-up fired it
        assert scheduled(events) == ["two seconds later"]
        assert rt._scheduler.fired == 1
    async with Runtime(url, config=config(clock)) as rt:  # and never again
        log = await rt.store.read_since("c", 0)
        assert scheduled(log) == ["two seconds later"]
        assert isinstance(log[-1].body, AssistantMessage)
        assert await rt.schedules("c") == []


async def test_mid_turn_a_firing_is_postponed_like_a_send(tmp_path: Path) -> None:
    clock = Clock()
    go, streaming = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("first "), Signal(streaming), Wait(go)], [Text("second")]])
    async with Runtime(f"sqlite:///{tmp_path}/s.db", model=model, config=config(clock)) as rt:
        turn = await rt.send("c", "long question")
        with anyio.fail_after(10):
            await streaming.wait()
        await rt.schedule("c", "meanwhile", after=1)
        clock.now += 1
        rt._scheduler.poke()
        with anyio.fail_after(10):  # logged while the turn streams: postponed behind it
            async with rt.subscribe("c", after=0) as follower:
                async for item in follower:
                    if isinstance(item, Event) and scheduled([item]):
                        break
        log = await rt.store.read_since("c", 0)
        assert not any(isinstance(e.body, AssistantMessage) for e in log)
        go.set()
        await turn.result()
        events = await answered(rt, "c", log[-1].position, answers=2)
        assert isinstance(events[-1].body, AssistantMessage)
        assert events[-1].body.text == "second"
        full = await rt.store.read_since("c", 0)
        kinds = [(type(e.body).__name__, e.turn) for e in full]
        assert kinds == [("UserMessage", 1), ("UserMessage", 2), ("AssistantMessage", 1),
                         ("AssistantMessage", 2)]


async def test_parked_drops_and_deleted_takes_schedules(tmp_path: Path) -> None:
    clock = Clock()
    url = f"sqlite:///{tmp_path}/s.db"
    async with Runtime(url, config=config(clock)) as rt:
        for c in ("p", "d"):
            await (await rt.send(c, "hi")).result()
            await rt.schedule(c, "later", after=5)
        head = await rt.store.head("p")
        await rt.store.append_events("p", [Parked("crash loop", restarts=5)], turn=1,
                                     expect_head=head)
        assert await rt.delete("d")
        assert await rt.schedules("d") == []
    clock.now += 5
    async with Runtime(url, config=config(clock)) as rt:
        with anyio.fail_after(10):
            while await rt.schedules("p"):  # noqa: ASYNC110 - the store's state, bounded
                await anyio.sleep(0.01)
        with pytest.raises(AgentParked):
            await rt.send("p", "still parked?")
        log = await rt.store.read_since("p", 0)
        assert scheduled(log) == []  # dropped, not logged
        assert (await rt.admin.schedules(limit=10)).schedules == ()


async def test_the_schedule_tool_within_max_schedules(tmp_path: Path) -> None:
    """The model schedules its own follow-ups, at most ``max_schedules`` pending; past it
    the call's result is an error and nothing is scheduled; it can cancel and list."""
    clock = Clock()
    adds = [Call("schedule", {"action": "add", "text": f"follow up {i}", "after_seconds": 60})
            for i in range(3)]
    model = ScriptedModel([
        adds, [Text("set")],
        [Call("schedule", {"action": "add", "text": "bad", "every_seconds": 0.01})],
        [Text("fixed")],
    ])
    agent = AgentConfig(schedule_tool=True, max_schedules=2)
    async with Runtime(f"sqlite:///{tmp_path}/s.db", model=model, agent=agent,
                       config=config(clock)) as rt:
        await (await rt.send("c", "remind me twice")).result()
        assert any(spec.name == "schedule" for spec in model.tool_specs[0])
        results = [e.body for e in await rt.store.read_since("c", 0)
                   if isinstance(e.body, ToolResult)]
        assert sorted(r.is_error for r in results) == [False, False, True]
        assert "2 pending schedules" in next(r.content for r in results if r.is_error)
        pending = await rt.schedules("c")
        assert len(pending) == 2 and all(s.text.startswith("follow up") for s in pending)
        await (await rt.send("c", "every 10 ms please")).result()
        last = [e.body for e in await rt.store.read_since("c", 0)
                if isinstance(e.body, ToolResult)][-1]
        assert last.is_error and "every" in last.content
    model = ScriptedModel([
        [Call("schedule", {"action": "cancel", "schedule_id": pending[0].id})],
        [Call("schedule", {"action": "list"})], [Text("done")],
    ])
    async with Runtime(f"sqlite:///{tmp_path}/s.db", model=model, agent=agent,
                       config=config(clock)) as rt:
        await (await rt.send("c", "cancel the first")).result()
        results = [e.body for e in await rt.store.read_since("c", 0)
                   if isinstance(e.body, ToolResult)][-2:]
        assert results[0].content == f"cancelled {pending[0].id}"
        assert pending[1].id in results[1].content and pending[0].id not in results[1].content
        assert [s.id for s in await rt.schedules("c")] == [pending[1].id]


async def test_the_schedule_tool_is_off_by_default(tmp_path: Path) -> None:
    model = ScriptedModel([[Call("schedule", {"action": "list"})], [Text("ok")]])
    async with Runtime(f"sqlite:///{tmp_path}/s.db", model=model) as rt:
        await (await rt.send("c", "hi")).result()
        assert not any(spec.name == "schedule" for spec in model.tool_specs[0])
        [result] = [e.body for e in await rt.store.read_since("c", 0)
                    if isinstance(e.body, ToolResult)]
        assert result.is_error  # an unknown tool


async def test_inspect_shows_a_conversations_schedules(tmp_path: Path) -> None:
    from test_cli import torpor

    url = f"sqlite:///{tmp_path}/s.db"
    async with Runtime(url) as rt:
        await (await rt.send("c", "hi")).result()
        s = await rt.schedule("c", "nightly digest", after=3600, every=86_400)
    shown = torpor("inspect", "--db", url, "c", "--json", "-")
    assert shown.returncode == 0, shown.stderr
    [listed] = json.loads(shown.stdout)["schedules"]
    assert listed["id"] == s.id and listed["every"] == 86_400 and listed["due"] == s.due
    table = torpor("inspect", "--db", url, "c", columns=200)
    assert table.returncode == 0, table.stderr
    assert "schedules" in table.stdout and "nightly digest" in table.stdout
