"""Issue 19: the actor is the only writer of its state.

It reads its mailbox in every state (a turn runs as its child task), so a
request made while a turn streams is answered while the turn still streams;
every state it takes, and every state the runtime reports about it, is a
transition of ``TRANSITIONS``; a drain ends postponed turns in the log as what
their callers are told.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import anyio
import pytest
from support import writes_fail, writes_succeed

from torpor import (
    Aborted,
    AgentConfig,
    AgentParked,
    AssistantMessage,
    ExternalTool,
    Parked,
    Runtime,
    RuntimeConfig,
    StoreUnavailable,
    Suspended,
    TurnAborted,
    UnknownCall,
    Unparked,
    UserMessage,
)
from torpor.actors.state import REPORTED, TRANSITIONS, AgentState
from torpor.llm.echo import EchoModel
from torpor.llm.scripted import Call, ScriptedModel, Signal, Text, Wait


def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'log.db'}"


async def test_requests_made_while_a_turn_streams_are_answered_while_it_streams(
    tmp_path: Path,
) -> None:
    go, streaming = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("part"), Signal(streaming), Wait(go), Text(" done")], "second"])
    async with Runtime(db(tmp_path), model=model) as rt:
        first = await rt.send("c", "one")
        with anyio.fail_after(10):  # a hang guard: nothing below waits for the turn
            await streaming.wait()
            with pytest.raises(UnknownCall):  # the turn waits for no call yet
                await rt.resolve("c", "call_1", "yes")
            second = await rt.send("c", "two")  # logged now, its turn after this one
            assert second.postponed and second.number == first.number + 1
            assert not go.is_set()
            assert (await rt.admin.inspect("c")).state == "streaming"
        go.set()
        with anyio.fail_after(10):
            assert isinstance(await first.result(), AssistantMessage)
            assert (await second.result()).text == "second"  # type: ignore[union-attr]


async def test_a_cancel_made_while_a_turn_streams_takes_effect_through_the_actor(
    tmp_path: Path,
) -> None:
    go, streaming = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("half"), Signal(streaming), Wait(go), Text(" never")]])
    async with Runtime(db(tmp_path), model=model) as rt:
        turn = await rt.send("c", "one")
        with anyio.fail_after(10):
            await streaming.wait()
            assert await rt.cancel("c") is True
            with pytest.raises(TurnAborted) as aborted:
                await turn.result()
        assert aborted.value.reason == "cancelled" and aborted.value.partial_text == "half"
        assert await rt.cancel("c") is False  # nothing open any more
        last = (await rt.history("c", limit=1))[0].body
        assert isinstance(last, Aborted) and last.reason == "cancelled"


async def test_a_postponed_turn_left_by_a_drain_is_logged_as_what_its_caller_was_told(
    tmp_path: Path,
) -> None:
    go, streaming = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("x"), Signal(streaming), Wait(go)]])
    async with Runtime(db(tmp_path), model=model) as rt:
        first = await rt.send("c", "one")
        with anyio.fail_after(10):
            await streaming.wait()
        second = await rt.send("c", "two")
        assert second.postponed
    for turn in (first, second):
        with pytest.raises(TurnAborted) as aborted:
            await turn.result()
        assert aborted.value.reason == "shutdown"
    async with Runtime(db(tmp_path), model=EchoModel()) as rt:
        events = await rt.store.read_since("c", 0)
        ends = {e.turn: e.body.reason for e in events if isinstance(e.body, Aborted)}
        assert ends == {first.number: "shutdown", second.number: "shutdown"}
        with anyio.fail_after(10):
            answer = await (await rt.send("c", "three")).result()
        assert answer.text == "echo: three"  # type: ignore[union-attr]
        events = await rt.store.read_since("c", 0)
        # Nothing was left for the next run to call interrupted.
        assert not [e for e in events if isinstance(e.body, Aborted)
                    and e.body.reason == "interrupted"]
        users = [e.turn for e in events if isinstance(e.body, UserMessage)]
        assert users == sorted(set(users))  # one number per message, in log order


APPROVE = ExternalTool("approve", "ask a person", {"type": "object"})


async def test_every_reported_transition_is_in_the_table(tmp_path: Path) -> None:
    """A scenario through every kind of state change; each one reported is declared."""
    model = ScriptedModel([[Call("approve", {}, id="a1")], "approved", "plain", "again"])
    config = RuntimeConfig(max_live_agents=1, hibernate_after=3600, evict_after=7200)
    async with Runtime(db(tmp_path), model=model, config=config,
                       agent=AgentConfig(tools=[APPROVE])) as rt:
        with rt.admin.watch() as watcher:
            with anyio.fail_after(20):
                assert isinstance(await (await rt.send("c", "pay")).result(), Suspended)
                assert await rt.admin.hibernate("c")
                continuation = await rt.resolve("c", "a1", "ok")
                assert continuation is not None
                await continuation.result()
                assert await rt.admin.evict("c")
                await (await rt.send("c", "more")).result()
                # Over the cap: another conversation queues, then gets the slot.
                queued = await rt.send("d", "hi")
                await queued.result()
            watcher.close()
            seen = [(t.old, t.new) async for t in watcher]
    states = {s.value: s for s in AgentState}
    pairs = {(states[old], states[new]) for old, new in seen}
    for old, new in pairs:
        assert new in TRANSITIONS[old], f"{old} -> {new} reported but not declared"
    reported = {new for _, new in pairs} | {old for old, _ in pairs}
    assert {AgentState.HIBERNATED, AgentState.EVICTED, AgentState.SUSPENDED,
            AgentState.STREAMING} <= reported
    assert set(TRANSITIONS) >= REPORTED


def test_the_table_has_no_transition_into_an_unknown_state() -> None:
    for old, targets in TRANSITIONS.items():
        assert targets <= set(AgentState), old
    assert set(TRANSITIONS) == set(AgentState)


async def test_unparking_is_a_request_the_parked_agent_acts_on_once(tmp_path: Path) -> None:
    """Two operators unpark at once: the actor logs one Unparked, answers one True and one
    False, and the conversation answers again (it was parked in memory, not evicted)."""
    url = db(tmp_path)
    model = ScriptedModel(["ok"] * 8, loop=True)
    config = RuntimeConfig(max_restarts=0, backoff_initial=0.0)
    async with Runtime(url, model=model, config=config) as rt:
        await (await rt.send("c", "hello")).result()
        # Parked by the log, as after a crash loop: a runtime reopened on it keeps it so.
        head = await rt.store.head("c")
        await rt.store.append_events("c", [Parked("crash loop", restarts=5)], turn=1,
                                     expect_head=head)
    async with Runtime(url, model=model, config=config) as rt:
        with pytest.raises(AgentParked):
            await rt.send("c", "anyone?")
        assert (await rt.admin.inspect("c")).state == "parked"
        with anyio.fail_after(10):
            first, second = await asyncio.gather(rt.admin.unpark("c"), rt.admin.unpark("c"))
        assert sorted([first, second]) == [False, True]
        events = await rt.store.read_since("c", 0)
        assert sum(isinstance(e.body, Unparked) for e in events) == 1
        with anyio.fail_after(10):
            assert (await (await rt.send("c", "back")).result()).text == "ok"  # type: ignore[union-attr]
        assert (await rt.admin.inspect("c")).state == "awaiting_input"


async def test_a_request_its_actor_cannot_take_while_the_store_fails_is_refused_in_time(
    tmp_path: Path,
) -> None:
    """While writes fail, a send whose agent is stuck before its mailbox (a revival held
    here) is taken back and refused with StoreUnavailable once store_retry_deadline
    passes; nothing of it is logged, and the agent answers once the store writes."""
    config = RuntimeConfig(store_retry_deadline=0.2)
    async with Runtime(db(tmp_path), model=EchoModel(), config=config) as rt:
        await (await rt.send("y", "before")).result()
        assert await rt.admin.evict("y")
        store = rt.store
        await writes_fail(store)
        with pytest.raises(StoreUnavailable):
            await rt.send("x", "refused")  # the store knows its writes fail now
        held, reached = anyio.Event(), anyio.Event()
        resume = store.resume

        async def held_resume(conversation_id: str) -> Any:
            if conversation_id == "y":
                reached.set()
                await held.wait()
            return await resume(conversation_id)

        store.resume = held_resume  # type: ignore[method-assign]
        try:
            with anyio.fail_after(10):  # a hang guard: the deadline is 0.2 s
                with pytest.raises(StoreUnavailable):
                    await rt.send("y", "stuck")
                assert reached.is_set()
        finally:
            held.set()
            store.resume = resume  # type: ignore[method-assign]
            await writes_succeed(store)
        with anyio.fail_after(10):
            answer = await (await rt.send("y", "after")).result()
        assert answer.text == "echo: after"  # type: ignore[union-attr]
        texts = [e.body.text for e in await store.read_since("y", 0)
                 if isinstance(e.body, UserMessage)]
        assert texts == ["before", "after"]
