"""rt.tool_interactions: every tool call paired with its result or its fate, from the log."""

from __future__ import annotations

import pytest

from torpor import AgentConfig, ExternalTool, InvalidInput, Runtime, ScriptedModel, tool
from torpor.llm import Call, Text


@tool
async def add(a: int, b: int) -> str:
    """Add two numbers."""
    return str(a + b)


@tool
async def explode() -> str:
    """Fail."""
    raise RuntimeError("kaboom")


async def test_calls_pair_with_results_errors_pending_and_aborted() -> None:
    model = ScriptedModel([
        [Call("add", {"a": 2, "b": 3}, id="c1"), Call("explode", {}, id="c2")],
        [Text("done")],
        [Call("approve", {"what": "deploy"}, id="c3")],
    ])
    agent = AgentConfig(model=model, tools=[add, explode, ExternalTool("approve")])
    async with Runtime("sqlite://", agent=agent) as rt:
        await (await rt.send("c", "compute")).result()
        await (await rt.send("c", "deploy?")).result()  # ends suspended on approve
        pending = await rt.tool_interactions("c")
        assert await rt.cancel("c") is True
        after = await rt.tool_interactions("c")
        assert await rt.tool_interactions("nobody") == []
        with pytest.raises(InvalidInput):
            await rt.tool_interactions("bad\x00id")
    first, second, third = pending
    assert (first.call_id, first.tool, first.arguments, first.status, first.result,
            first.turn) == ("c1", "add", {"a": 2, "b": 3}, "success", "5", 1)
    assert first.result_position is not None and first.result_position > first.call_position
    assert (second.call_id, second.status, second.turn) == ("c2", "error", 1)
    assert second.result is not None and "kaboom" in second.result
    assert (third.call_id, third.tool, third.status, third.result, third.turn) == (
        "c3", "approve", "pending", None, 2)
    assert [i.status for i in after] == ["success", "error", "aborted"]


async def test_the_admin_shows_memory_without_waking_the_agent() -> None:
    async with Runtime("sqlite://") as rt:
        await (await rt.send("c", "hi")).result()
        await rt.admin.evict("c")
        view = await rt.admin.memory("c")
        assert view.record.conversation_id == "c" and view.digest.lines == ()
        assert [a.conversation_id for a in await rt.admin.agents()] == []


async def test_a_call_id_used_again_in_a_later_turn_pairs_with_its_own_result() -> None:
    # Some providers number calls per response: "call_0" in every turn.
    model = ScriptedModel([
        [Call("add", {"a": 1, "b": 1}, id="call_0")], [Text("two")],
        [Call("add", {"a": 2, "b": 2}, id="call_0")], [Text("four")],
        [Call("approve", {}, id="call_0")],
    ])
    agent = AgentConfig(model=model, tools=[add, ExternalTool("approve")])
    async with Runtime("sqlite://", agent=agent) as rt:
        for text in ("one plus one", "two plus two", "deploy?"):
            await (await rt.send("c", text)).result()
        seen = await rt.tool_interactions("c")
    assert [(i.turn, i.arguments, i.status, i.result) for i in seen] == [
        (1, {"a": 1, "b": 1}, "success", "2"),
        (2, {"a": 2, "b": 2}, "success", "4"),
        (3, {}, "pending", None),
    ]
    assert all(i.result_position is None or i.result_position > i.call_position for i in seen)
