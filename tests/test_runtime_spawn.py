"""Sub-agents (issue 13, design source 004): rt.spawn links a child conversation to a
parent's pending tool call; the child's answer resolves the call, across eviction and
restarts, exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from store_backends import Backend

import torpor
from torpor import (
    AgentConfig,
    AssistantMessage,
    Event,
    ExternalTool,
    Resolved,
    Runtime,
    Spawned,
    Suspended,
    ToolResult,
    UserMessage,
)
from torpor.llm.scripted import Call, ScriptedModel, Text, Wait
from torpor.runtime.spawn import CONTINUE

RESEARCH = ExternalTool("research", "ask a sub-agent")


def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'log.db'}"


def parent_config(*answers: str) -> AgentConfig:
    steps: list[object] = [[Call("research", {"q": "x"}, id="r1")]]
    steps += [[Text(a)] for a in answers]
    return AgentConfig(model=ScriptedModel(steps), tools=[RESEARCH], recall_tools=False)


def child_config(*steps: object) -> AgentConfig:
    return AgentConfig(model=ScriptedModel(list(steps)), recall_tools=False)


async def suspended_parent(rt: Runtime, parent: str = "p") -> int:
    outcome = await (await rt.send(parent, "go")).result()
    assert isinstance(outcome, Suspended) and outcome.call_ids == ("r1",)
    head = await rt.store.head(parent)
    assert head is not None
    return head


async def final_answer(rt: Runtime, conversation: str, after: int) -> AssistantMessage:
    with anyio.fail_after(20):
        async with rt.subscribe(conversation, after=after) as follower:
            async for item in follower:
                if isinstance(item, Event) and isinstance(item.body, AssistantMessage) \
                        and not item.body.tool_calls:
                    return item.body
    raise AssertionError("the follower ended")


async def bodies(rt: Runtime, conversation: str) -> list[object]:
    return [e.body for e in reversed(await rt.history(conversation, limit=1000))]


async def test_the_childs_answer_becomes_the_parents_tool_result(tmp_path: Path) -> None:
    async with Runtime(db(tmp_path), agent=parent_config("parent done")) as rt:
        head = await suspended_parent(rt)
        child = await rt.spawn("p", "r1", task="find x", agent=child_config("x is 42"))
        assert child == "p/r1"
        assert (await final_answer(rt, "p", head)).text == "parent done"
        parent_log = await bodies(rt, "p")
        assert Spawned("p", "r1", "p/r1") in parent_log
        results = [b for b in parent_log if isinstance(b, ToolResult)]
        assert [(r.call_id, r.content, r.is_error) for r in results] == [("r1", "x is 42", False)]
        assert Resolved("r1") in parent_log
        child_log = await bodies(rt, child)
        assert child_log[:2] == [Spawned("p", "r1", "p/r1", "find x"), UserMessage("find x")]
        assert AssistantMessage("x is 42") in child_log
        # The child is a conversation of its own: searchable, and the tree shows the link.
        assert [h.position for h in await rt.recall(child, "42", 5)] == [2]
        tree = await rt.admin.branches("p")
        assert tree.parent is None and [c.conversation_id for c in tree.children] == [child]
        assert tree.children[0].status == "done" and tree.children[0].call_id == "r1"
        assert (await rt.admin.branches(child)).parent == "p"


async def test_a_bad_parent_or_call_is_a_typed_error_and_spawning_twice_links_once(
    tmp_path: Path,
) -> None:
    gate = anyio.Event()
    async with Runtime(db(tmp_path), agent=parent_config("parent done")) as rt:
        with pytest.raises(torpor.UnknownConversation):
            await rt.spawn("nobody", "r1", task="t")
        head = await suspended_parent(rt)
        with pytest.raises(torpor.UnknownCall):
            await rt.spawn("p", "r9", task="t")
        assert await rt.store.head("p/r9") is None  # refused before anything was written
        await rt.store.append("other", [UserMessage("hello")])
        with pytest.raises(torpor.InvalidInput):
            await rt.spawn("p", "r1", task="t", child="other")
        with pytest.raises(torpor.InvalidInput):
            await rt.spawn("p", "r1", task="t", child="p")
        config = child_config([Wait(gate), Text("done")])
        first = await rt.spawn("p", "r1", task="t", agent=config)
        again = await rt.spawn("p", "r1", task="t", agent=config)
        assert first == again
        gate.set()
        await final_answer(rt, "p", head)
        links = [b for b in await bodies(rt, "p") if isinstance(b, Spawned)]
        assert len(links) == 1
        assert [b for b in await bodies(rt, first) if isinstance(b, UserMessage)] == [
            UserMessage("t")
        ]
        with pytest.raises(torpor.UnknownCall):  # answered: the call is no longer pending
            await rt.spawn("p", "r1", task="t")


async def test_a_child_that_fails_answers_with_an_error_result(tmp_path: Path) -> None:
    async with Runtime(db(tmp_path), agent=parent_config("parent done")) as rt:
        head = await suspended_parent(rt)
        boom = torpor.ModelBadRequest("bad request", provider="test")
        await rt.spawn("p", "r1", task="t", agent=child_config([torpor.llm.Fail(boom)]))
        await final_answer(rt, "p", head)
        (result,) = [b for b in await bodies(rt, "p") if isinstance(b, ToolResult)]
        assert result.is_error and "model_error" in result.content


async def test_a_child_still_running_survives_the_parents_eviction(tmp_path: Path) -> None:
    gate = anyio.Event()
    async with Runtime(db(tmp_path), agent=parent_config("parent done")) as rt:
        head = await suspended_parent(rt)
        child = await rt.spawn("p", "r1", task="t",
                               agent=child_config([Wait(gate), Text("late answer")]))
        assert await rt.admin.evict("p")
        assert "p" not in {a.conversation_id for a in await rt.admin.agents()}
        assert child in {a.conversation_id for a in await rt.admin.agents()}
        gate.set()
        assert (await final_answer(rt, "p", head)).text == "parent done"
        (result,) = [b for b in await bodies(rt, "p") if isinstance(b, ToolResult)]
        assert result.content == "late answer"


async def test_a_child_running_at_shutdown_is_continued_after_a_restart(tmp_path: Path) -> None:
    gate = anyio.Event()  # never set: the first run stops mid-answer
    async with Runtime(db(tmp_path), agent=parent_config()) as rt:
        head = await suspended_parent(rt)
        await rt.spawn("p", "r1", task="t", agent=child_config([Wait(gate), Text("never")]))
    child_model = ScriptedModel([[Text("answer after restart")]])
    parent_model = ScriptedModel([[Text("parent done")]])
    configs = {
        "p/r1": AgentConfig(model=child_model, recall_tools=False),
        "p": AgentConfig(model=parent_model, tools=[RESEARCH], recall_tools=False),
    }
    async with Runtime(db(tmp_path), agent_for=configs.__getitem__) as rt:
        assert (await final_answer(rt, "p", head)).text == "parent done"
        child_log = await bodies(rt, "p/r1")
        assert UserMessage(CONTINUE) in child_log  # told to continue the dead turn
        (result,) = [b for b in await bodies(rt, "p") if isinstance(b, ToolResult)]
        assert result.content == "answer after restart"


async def test_a_child_that_finished_before_a_crash_resolves_its_parent_exactly_once(
    backend: Backend,
) -> None:
    url = f"sqlite:///{backend.location}" if backend.name == "sqlite" else str(backend.location)
    async with Runtime(url, agent=parent_config()) as rt:
        head = await suspended_parent(rt)
    # The crash: both logs hold the link and the child answered, the parent was never told.
    async with torpor.open_store(url) as store:
        await store.append("p", [Spawned("p", "r1", "kid")], turn=1)
        await store.append("kid", [Spawned("p", "r1", "kid", "t"), UserMessage("t")], turn=1)
        await store.append("kid", [AssistantMessage("answered before the crash")], turn=1)
    config = AgentConfig(model=ScriptedModel([[Text("parent done")]]), tools=[RESEARCH],
                         recall_tools=False)
    for _ in range(2):  # two restarts: resolved by the first only
        async with Runtime(url, agent=config) as rt:
            if _ == 0:
                assert (await final_answer(rt, "p", head)).text == "parent done"
            results = [b for b in await bodies(rt, "p") if isinstance(b, ToolResult)]
            assert [r.content for r in results] == ["answered before the crash"]
            assert (await rt.admin.branches("p")).children[0].status == "done"


def test_torpor_inspect_shows_the_tree(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Runtime(db(tmp_path), agent=parent_config("parent done")) as rt:
            head = await suspended_parent(rt)
            await rt.spawn("p", "r1", task="find x", agent=child_config("x is 42"))
            await final_answer(rt, "p", head)

    asyncio.run(scenario())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "COLUMNS": "120"}
    for conversation, expected in (("p", "-> p/r1 [r1] (done)"), ("p/r1", "answers p [r1]")):
        out = subprocess.run(
            [sys.executable, "-m", "torpor", "inspect", "--db", db(tmp_path), conversation],
            capture_output=True, text=True, env=env, timeout=60, check=True,
        ).stdout
        assert "sub-agent tree" in out and expected in out


async def test_the_http_admin_shows_the_tree(tmp_path: Path) -> None:
    from serve_support import ADMIN, served

    from torpor.serve.client import Client

    async with Runtime(db(tmp_path), agent=parent_config("parent done")) as rt:
        head = await suspended_parent(rt)
        await rt.spawn("p", "r1", task="find x", agent=child_config("x is 42"))
        await final_answer(rt, "p", head)
        async with served(rt) as (url, _, _app):
            admin = Client(url, ADMIN)
            tree = await admin.call("GET", "/admin/branches/p")
            assert [(c["conversation_id"], c["status"]) for c in tree["children"]] == [
                ("p/r1", "done")
            ]
            assert (await admin.call("GET", "/admin/branches/p/r1"))["parent"] == "p"


KILLED = textwrap.dedent(
    """
    import sys, anyio, logging, structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    from torpor import AgentConfig, ExternalTool, Runtime, ScriptedModel, Suspended
    from torpor.llm import Call, Signal, Text, Wait

    async def main() -> None:
        reached, never = anyio.Event(), anyio.Event()
        parent = AgentConfig(model=ScriptedModel([[Call("research", {}, id="r1")]]),
                             tools=[ExternalTool("research")], recall_tools=False)
        child = AgentConfig(model=ScriptedModel([[Text("half"), Signal(reached), Wait(never)]]),
                            recall_tools=False)
        async with Runtime(sys.argv[1], agent=parent) as rt:
            outcome = await (await rt.send("p", "go")).result()
            assert isinstance(outcome, Suspended)
            await rt.spawn("p", "r1", task="dig", agent=child)
            await reached.wait()
            print("streaming", flush=True)
            await never.wait()

    anyio.run(main)
    """
)


def run_until_the_child_streams_then_kill(url: str) -> None:
    """Blocking on purpose: the process's line is the synchronisation point, then SIGKILL."""
    process = subprocess.Popen([sys.executable, "-c", KILLED, url], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "streaming"
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()


async def test_a_child_killed_mid_answer_is_continued_and_resolves_its_parent_once(
    tmp_path: Path,
) -> None:
    url = db(tmp_path)
    run_until_the_child_streams_then_kill(url)
    configs = {
        "p/r1": child_config("dug it up"),
        "p": AgentConfig(model=ScriptedModel([[Text("parent done")]]), tools=[RESEARCH],
                         recall_tools=False),
    }
    async with Runtime(url, agent_for=configs.__getitem__) as rt:
        head = await rt.store.head("p")
        assert head is not None
        assert (await final_answer(rt, "p", head)).text == "parent done"
        child_log = await bodies(rt, "p/r1")
        interrupted = [b for b in child_log if isinstance(b, torpor.Aborted)]
        assert [a.reason for a in interrupted] == ["interrupted"]
        assert child_log.count(UserMessage(CONTINUE)) == 1
        (result,) = [b for b in await bodies(rt, "p") if isinstance(b, ToolResult)]
        assert result.content == "dug it up"
