"""Hibernate, evict, revive, suspension across them, activation storms, a quiet admin."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

import torpor
from torpor import (
    Aborted,
    AgentConfig,
    EchoModel,
    ExternalTool,
    Resolved,
    Runtime,
    RuntimeConfig,
    ScriptedModel,
    Suspended,
    ToolResult,
    UnknownCall,
    UserMessage,
)
from torpor.llm import Call, Text

APPROVE = ExternalTool("approve", "Ask a human to approve", {
    "type": "object", "properties": {"what": {"type": "string"}}, "required": ["what"]})


def approval_model() -> ScriptedModel:
    return ScriptedModel([[Text("asking"), Call("approve", {"what": "deploy"}, id="c1")],
                          [Text("deployed")]])


async def settle() -> None:
    await anyio.wait_all_tasks_blocked()


async def test_hibernate_drops_the_working_set_and_the_next_message_reloads_it() -> None:
    async with Runtime("sqlite://", model=EchoModel()) as rt:
        await (await rt.send("c", "one")).result()
        await settle()
        before = (await rt.admin.stats())
        assert before.with_working_set == 1 and before.tasks == 1
        assert (await rt.admin.hibernate("c")) is True
        await settle()
        info = await rt.admin.inspect("c")
        assert info.hibernated and info.working_set_bytes == 0 and info.live
        assert (await rt.admin.stats()).tasks == 0  # a hibernated agent keeps no task
        revivals = (await rt.admin.stats()).revivals
        assert (await (await rt.send("c", "two")).result()).text == "echo: two"
        assert (await rt.admin.stats()).revivals == revivals + 1


async def test_sweep_hibernates_then_evicts_by_idle_time_without_sleeping() -> None:
    config = RuntimeConfig(hibernate_after=10, evict_after=20, sweep_interval=3600)
    async with Runtime("sqlite://", model=EchoModel(), config=config) as rt:
        for conv in ("a", "b", "c"):
            await (await rt.send(conv, "hi")).result()
        await settle()
        now = time.monotonic()
        assert await rt.admin.sweep(now) == (0, 0)
        assert await rt.admin.sweep(now + 15) == (3, 0)
        await settle()
        assert (await rt.admin.stats()).hibernated == 3
        assert await rt.admin.sweep(now + 25) == (0, 3)
        assert (await rt.admin.stats()).live == 0
        assert (await rt.admin.stats()).evictions == 3
        # Evicted, yet nothing is lost: the next message revives from the log.
        assert (await (await rt.send("b", "back")).result()).text == "echo: back"
        assert len(await rt.history("b")) == 4


async def test_a_streaming_agent_is_never_hibernated_or_evicted() -> None:
    go = anyio.Event()
    from torpor.llm import Wait

    model = ScriptedModel([[Wait(go), Text("done")]])
    config = RuntimeConfig(hibernate_after=1, evict_after=1, sweep_interval=3600)
    async with Runtime("sqlite://", model=model, config=config) as rt:
        turn = await rt.send("c", "long")
        await settle()
        assert await rt.admin.sweep(time.monotonic() + 100) == (0, 0)
        assert (await rt.admin.evict("c")) is False
        go.set()
        assert (await turn.result()).text == "done"


async def test_suspended_survives_evict_and_revive_then_resolves() -> None:
    async with Runtime("sqlite://", model=approval_model(),
                       agent=AgentConfig(tools=[APPROVE])) as rt:
        turn = await rt.send("c", "deploy please")
        items = [item async for item in _until_suspended(turn)]
        assert isinstance(items[-1].body, Suspended)
        await settle()
        info = await rt.admin.inspect("c")
        assert info.state == "suspended" and info.pending_calls == ("c1",)
        assert (await rt.admin.evict("c")) is True
        await settle()
        evicted = await rt.admin.inspect("c")
        assert evicted.state == "evicted" and evicted.pending_calls == ("c1",)
        with pytest.raises(UnknownCall):
            await rt.resolve("c", "other", "yes")
        resumed = await rt.resolve("c", "c1", "approved")
        assert resumed is not None
        assert (await resumed.result()).text == "deployed"
        bodies = [e.body for e in reversed(await rt.history("c"))]
        assert isinstance(bodies[-3], ToolResult) and bodies[-3].content == "approved"
        assert isinstance(bodies[-2], Resolved)
        assert (await rt.admin.inspect("c")).state == "awaiting_input"


async def _until_suspended(turn: torpor.Turn):  # type: ignore[no-untyped-def]
    async for item in turn:
        if isinstance(item, torpor.Event):
            yield item
            if isinstance(item.body, Suspended):
                return


async def test_suspension_survives_a_full_runtime_restart(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    agent = AgentConfig(tools=[APPROVE])
    model = approval_model()
    async with Runtime(url, model=model, agent=agent) as rt:
        turn = await rt.send("c", "deploy")
        async for _ in _until_suspended(turn):
            pass
    async with Runtime(url, model=model, agent=agent) as rt2:
        info = await rt2.admin.inspect("c")
        assert info.state == "evicted" and info.pending_calls == ("c1",)
        assert (await rt2.admin.stats()).revivals == 0  # inspect did not wake it
        resumed = await rt2.resolve("c", "c1", "ok")
        assert resumed is not None and (await resumed.result()).text == "deployed"
        # new input while suspended is postponed, not refused, and lands after the answer
        users = [e.body.text for e in reversed(await rt2.history("c"))
                 if isinstance(e.body, UserMessage)]
        assert users == ["deploy"]


async def test_input_while_suspended_is_logged_at_once_and_runs_after_resolution() -> None:
    model = ScriptedModel([[Call("approve", {"what": "x"}, id="c1")], [Text("ok done")],
                           [Text("next answer")]])
    async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[APPROVE])) as rt:
        turn = await rt.send("c", "start")
        async for _ in _until_suspended(turn):
            pass
        suspension = await turn.result()
        assert isinstance(suspension, Suspended) and suspension.call_ids == ("c1",)
        later = await rt.send("c", "are you there?")  # returns at once: it is in the log
        assert later.postponed and not later.done()
        newest = (await rt.history("c", limit=1))[0]
        assert isinstance(newest.body, UserMessage) and newest.body.text == "are you there?"
        assert (await rt.admin.inspect("c")).state == "suspended"
        resumed = await rt.resolve("c", "c1", "yes")
        assert resumed is not None and resumed.continuation
        assert (await resumed.result()).text == "ok done"
        assert (await later.result()).text == "next answer"
        kinds = [type(e.body).__name__ for e in reversed(await rt.history("c"))]
        assert kinds == ["UserMessage", "AssistantMessage", "Suspended", "UserMessage",
                         "ToolResult", "Resolved", "AssistantMessage", "AssistantMessage"]
        # The model saw the postponed message after the turn it waited behind.
        assert "are you there?" not in str(model.calls[1])
        roles = [type(m).__name__ for m in model.calls[2]]
        assert roles[-3:] == ["ToolResult", "AssistantMessage", "UserMessage"]


@pytest.mark.parametrize("how", ["evict", "restart"])
async def test_input_while_suspended_survives_eviction_and_restart(
    tmp_path: Path, how: str
) -> None:
    url = f"sqlite:///{tmp_path}/p.db"
    model = ScriptedModel([[Call("approve", {"what": "x"}, id="c1")], [Text("ok done")],
                           [Text("second answer")], [Text("third answer")]])
    agent = AgentConfig(tools=[APPROVE])
    async with Runtime(url, model=model, agent=agent) as rt:
        await (await rt.send("c", "start")).result()
        second = await rt.send("c", "second")
        third = await rt.send("c", "third")
        await settle()
        if how == "evict":
            assert await rt.admin.hibernate("c")
            await settle()
            assert not await rt.admin.evict("c")  # postponed turns' handles live on it
            resumed = await rt.resolve("c", "c1", "yes")
            assert resumed is not None and (await resumed.result()).text == "ok done"
            assert (await second.result()).text == "second answer"
            assert (await third.result()).text == "third answer"
    if how == "restart":
        async with Runtime(url, model=model, agent=agent) as rt2:
            info = await rt2.admin.inspect("c")
            assert info.state == "evicted" and info.pending_calls == ("c1",)
            resumed = await rt2.resolve("c", "c1", "yes")
            assert resumed is not None and (await resumed.result()).text == "ok done"
            follower = rt2.subscribe("c", after=-1)
            async with follower:
                async for item in follower:
                    if isinstance(item, torpor.Event) and isinstance(
                        item.body, torpor.AssistantMessage
                    ) and item.body.text == "third answer":
                        break
    async with Runtime(url, model=EchoModel(), agent=agent) as rt3:
        events = list(reversed(await rt3.history("c")))
    answers = [e.body.text for e in events if isinstance(e.body, torpor.AssistantMessage)]
    assert answers[-3:] == ["ok done", "second answer", "third answer"]
    users = [e.body.text for e in events if isinstance(e.body, UserMessage)]
    assert users == ["start", "second", "third"]  # each logged once, in order


async def test_cancel_a_suspended_turn() -> None:
    async with Runtime("sqlite://", model=approval_model(),
                       agent=AgentConfig(tools=[APPROVE])) as rt:
        async for _ in _until_suspended(await rt.send("c", "deploy")):
            pass
        await settle()
        assert await rt.cancel("c") is True
        last = (await rt.history("c", limit=1))[0].body
        assert isinstance(last, Aborted) and last.reason == "cancelled"
        assert (await rt.admin.inspect("c")).state == "awaiting_input"


async def test_unfinished_turn_found_on_revival_gets_its_aborted_event(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/u.db"
    async with torpor.open_store(url) as store:  # a process that died right after the append
        await store.append("c", [UserMessage("lost in the crash")], turn=1)
    async with Runtime(url, model=EchoModel()) as rt:
        final = await (await rt.send("c", "hello again")).result()
        assert final.text == "echo: hello again"
        bodies = [e.body for e in reversed(await rt.history("c"))]
        assert isinstance(bodies[1], Aborted) and bodies[1].reason == "interrupted"
        assert [e.turn for e in reversed(await rt.history("c"))] == [1, 1, 2, 2]


async def test_many_concurrent_first_messages_activate_each_conversation_once() -> None:
    async with Runtime("sqlite://", model=EchoModel(),
                       config=RuntimeConfig(mailbox_bound=64)) as rt:
        turns: list[torpor.Turn] = []

        async def send(conv: str, i: int) -> None:
            turns.append(await rt.send(conv, f"m{i}"))

        async with anyio.create_task_group() as tg:
            for i in range(1000):
                tg.start_soon(send, f"conv-{i % 100}", i)
        for turn in turns:
            await turn.result()
        stats = (await rt.admin.stats())
        assert stats.activations == 100
        assert stats.revivals == 100
        for n in (0, 57, 99):
            users = [e for e in await rt.history(f"conv-{n}", limit=100)
                     if isinstance(e.body, UserMessage)]
            assert len(users) == 10


async def test_admin_on_an_evicted_conversation_does_not_revive_it() -> None:
    async with Runtime("sqlite://", model=EchoModel()) as rt:
        await (await rt.send("c", "x")).result()
        await settle()
        assert (await rt.admin.evict("c"))
        await settle()
        stats = await rt.admin.stats()
        revivals, activations = stats.revivals, stats.activations
        info = await rt.admin.inspect("c")
        assert info.state == "evicted" and not info.live and info.head == 1
        assert await rt.history("c")
        assert (await rt.admin.agents()) == []
        assert (await rt.admin.stats()).revivals == revivals
        assert (await rt.admin.stats()).activations == activations
        with pytest.raises(torpor.UnknownConversation):
            await rt.admin.inspect("never-seen")


async def test_watch_reports_lifecycle_transitions() -> None:
    async with Runtime("sqlite://", model=EchoModel()) as rt:
        seen: list[tuple[str, str]] = []

        async def watch() -> None:
            async for t in rt.admin.watch():
                seen.append((t.old, t.new))
                if t.new == "evicted":
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await settle()
            await (await rt.send("c", "x")).result()
            await settle()
            (await rt.admin.evict("c"))
        assert ("evicted", "reviving") in seen
        assert ("reviving", "awaiting_input") in seen
        assert ("awaiting_input", "streaming") in seen
        assert ("streaming", "awaiting_input") in seen
        assert seen[-1][1] == "evicted"


async def test_live_agent_cap_evicts_least_recently_used() -> None:
    config = RuntimeConfig(max_live_agents=3)
    async with Runtime("sqlite://", model=EchoModel(), config=config) as rt:
        for conv in ("a", "b", "c", "d", "e"):
            await (await rt.send(conv, "hi")).result()
            await settle()
        live = {a.conversation_id for a in (await rt.admin.agents())}
        assert live == {"c", "d", "e"}
        assert (await rt.admin.stats()).evictions == 2


async def test_live_agent_cap_holds_after_a_burst_of_first_messages() -> None:
    config = RuntimeConfig(max_live_agents=10, mailbox_bound=4)
    async with Runtime("sqlite://", model=EchoModel(), config=config) as rt:
        turns: list[torpor.Turn] = []

        async def send(conv: str) -> None:
            turns.append(await rt.send(conv, "hi"))

        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(send, f"burst-{i}")
        for turn in turns:
            await turn.result()
        await settle()
        assert (await rt.admin.stats()).live <= 10
        assert (await rt.admin.stats()).evictions >= 90


async def test_resolve_while_a_turn_streams_answers_at_once_and_does_not_hold_sends() -> None:
    # Found by the fuzzer: a resolve for a call the agent is not waiting for was queued
    # behind the running turn, so it (and every send after it) waited for the turn to end.
    go = anyio.Event()
    model = ScriptedModel([[Text("thinking"), torpor.llm.Wait(go), Text(" done")],
                           [Text("second")]])
    async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[APPROVE])) as rt:
        turn = await rt.send("c", "first")
        await settle()
        with anyio.fail_after(5):
            with pytest.raises(UnknownCall):
                await rt.resolve("c", "nope", "yes")
            later = await rt.send("c", "second message")
        assert later.postponed and not later.done()
        go.set()
        assert (await turn.result()).text == "thinking done"
        assert (await later.result()).text == "second"


async def test_resolve_before_the_suspension_is_refused_while_local_tools_run() -> None:
    # Found by the fuzzer: an answer for an outside call of the running model answer was
    # queued until its local calls finished, so a hanging local tool held it (and every
    # request behind it). The call is not awaited until the turn suspends on it.
    started, release = anyio.Event(), anyio.Event()

    @torpor.tool
    async def slow() -> str:
        """Takes as long as it takes."""
        started.set()
        await release.wait()
        return "slow done"

    model = ScriptedModel([[Call("slow", id="s1"), Call("approve", {"what": "x"}, id="c1")],
                           [Text("all done")]])
    async with Runtime("sqlite://", model=model,
                       agent=AgentConfig(tools=[slow, APPROVE])) as rt:
        turn = await rt.send("c", "go")
        await started.wait()
        assert (await rt.admin.inspect("c")).state == "running_tools"
        with anyio.fail_after(5), pytest.raises(UnknownCall):
            await rt.resolve("c", "c1", "too early")
        release.set()
        suspended = await turn.result()
        assert isinstance(suspended, Suspended) and suspended.call_ids == ("c1",)
        resumed = await rt.resolve("c", "c1", "now")
        assert resumed is not None and (await resumed.result()).text == "all done"
