"""MCP tools that need an approval: the turn suspends, ``resolve(..., APPROVED)`` runs the call
once (after an eviction, a restart, a retried resolve), any other answer is the result."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mcp")

from mcp_servers import Probe
from test_mcp_tools import mcp_http, results

from torpor import AgentConfig, Runtime, ScriptedModel
from torpor.events import Resolved, Suspended
from torpor.llm import Call, Text
from torpor.mcp import APPROVED, MCPServerHTTP


def wiping() -> ScriptedModel:
    return ScriptedModel([[Call("wipe", {"target": "disk"}, id="w"), Call("add", {"a": 1, "b": 2},
                                                                           id="a")],
                          [Text("wiped")]])


async def test_a_destructive_tool_waits_for_approval_and_runs_once_after_eviction() -> None:
    probe = Probe()
    async with mcp_http(probe) as url:
        config = AgentConfig(mcp_servers=[MCPServerHTTP(url)])
        async with Runtime(model=wiping(), agent=config) as rt:
            suspended = await (await rt.send("c", "wipe it")).result()
            assert isinstance(suspended, Suspended)
            assert suspended.call_ids == ("w",) and suspended.approvals == ("w",)
            assert probe.wiped == 0  # not before the approval
            assert await rt.admin.evict("c")  # nothing of the agent is in memory now
            turn = await rt.resolve("c", "w", APPROVED, key="approve-w")
            assert turn is not None
            final = await turn.result()
            again = await rt.resolve("c", "w", APPROVED, key="approve-w")  # a retry
            got = {r.call_id: r for r in await results(rt, "c")}
            events = await rt.store.read_since("c", 0)
    assert final.text == "wiped"
    assert probe.wiped == 1  # exactly once, the retry included
    assert again is not None and (await again.result()).text == "wiped"
    assert got["w"].content == "wiped disk (call 1)" and not got["w"].is_error
    assert got["a"].content == "3"  # the ungated call ran at once
    approvals = [e.body for e in events if isinstance(e.body, Resolved)]
    assert approvals == [Resolved("w", approval=APPROVED)]


async def test_an_approval_after_a_restart_runs_the_call(tmp_path: Path) -> None:
    probe = Probe()
    url_db = f"sqlite:///{tmp_path / 'chat.db'}"
    async with mcp_http(probe) as url:
        config = AgentConfig(mcp_servers=[MCPServerHTTP(url)])
        async with Runtime(url_db, model=wiping(), agent=config) as rt:
            assert isinstance(await (await rt.send("c", "wipe it")).result(), Suspended)
        model = ScriptedModel([[Text("wiped after the restart")]])
        async with Runtime(url_db, model=model, agent=config) as rt:
            turn = await rt.resolve("c", "w", " Approved ")
            assert turn is not None
            final = await turn.result()
            got = {r.call_id: r for r in await results(rt, "c")}
    assert final.text == "wiped after the restart"
    assert probe.wiped == 1
    assert got["w"].content == "wiped disk (call 1)"


async def test_a_refusal_is_the_result_and_nothing_runs() -> None:
    probe = Probe()
    async with mcp_http(probe) as url:
        config = AgentConfig(mcp_servers=[MCPServerHTTP(url)])
        async with Runtime(model=wiping(), agent=config) as rt:
            await (await rt.send("c", "wipe it")).result()
            turn = await rt.resolve("c", "w", "denied: not this disk", is_error=True)
            assert turn is not None
            await turn.result()
            got = {r.call_id: r for r in await results(rt, "c")}
    assert probe.wiped == 0
    assert got["w"].content == "denied: not this disk" and got["w"].is_error


async def test_require_approval_names_tools_and_bad_arguments_are_not_asked_about() -> None:
    probe = Probe()
    async with mcp_http(probe) as url:
        model = ScriptedModel([[Call("add", {"a": 1, "b": 2}, id="a"),
                                Call("add", {"a": "one"}, id="bad")],
                               [Text("added")]])
        config = AgentConfig(mcp_servers=[MCPServerHTTP(url, require_approval={"add"})])
        async with Runtime(model=model, agent=config) as rt:
            suspended = await (await rt.send("c", "add")).result()
            assert isinstance(suspended, Suspended) and suspended.approvals == ("a",)
            first = {r.call_id: r for r in await results(rt, "c")}
            turn = await rt.resolve("c", "a", APPROVED)
            assert turn is not None
            await turn.result()
            got = {r.call_id: r for r in await results(rt, "c")}
    assert first["bad"].is_error and "'b'" in first["bad"].content  # the model's to fix
    assert got["a"].content == "3"
