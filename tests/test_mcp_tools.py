"""MCP tools from an SDK server (MCPServer) served over streamable HTTP in the test's process:
timeouts, cancellation, a 1 MB answer, errors, list changes, names, filters, sharing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

pytest.importorskip("mcp")

from mcp_servers import BIG, Probe, make_server
from serve_support import serving

from torpor import AgentConfig, Runtime, ScriptedModel, tool
from torpor.events import ToolResult
from torpor.llm import Call, Text
from torpor.mcp import MCPServerHTTP


@asynccontextmanager
async def mcp_http(probe: Probe) -> AsyncIterator[str]:
    async with serving(make_server(probe).streamable_http_app()) as base:
        yield f"{base}/mcp"


async def results(rt: Runtime, conversation_id: str) -> list[ToolResult]:
    events = await rt.store.read_since(conversation_id, 0)
    return [e.body for e in events if isinstance(e.body, ToolResult)]


async def test_calls_run_and_errors_are_results() -> None:
    probe = Probe()
    async with mcp_http(probe) as url:
        model = ScriptedModel([[Call("add", {"a": 2, "b": 40}, id="a"), Call("fail", {}, id="f")],
                               [Text("ok")]])
        config = AgentConfig(mcp_servers=[MCPServerHTTP(url, name="test")])
        async with Runtime(model=model, agent=config) as rt:
            final = await (await rt.send("c", "go")).result()
            got = {r.call_id: r for r in await results(rt, "c")}
    assert final.text == "ok"
    assert got["a"].content == "42" and not got["a"].is_error
    assert got["f"].is_error and "failed on purpose" in got["f"].content
    assert {"add", "hang", "wipe"} <= {s.name for s in model.tool_specs[0]}


async def test_a_tool_that_never_answers_times_out_and_the_server_is_told() -> None:
    probe = Probe()
    async with mcp_http(probe) as url:
        model = ScriptedModel([[Call("hang", {}, id="h")], [Text("went on")]])
        config = AgentConfig(mcp_servers=[MCPServerHTTP(url)], tool_timeout=0.5)
        async with Runtime(model=model, agent=config) as rt:
            final = await (await rt.send("c", "go")).result()
            (result,) = await results(rt, "c")
            with anyio.fail_after(10):  # the cancellation notification reached the tool
                await probe.hang_cancelled.wait()
    assert final.text == "went on"
    assert result.is_error and "timed out after 0.5 seconds" in result.content


async def test_cancel_of_the_turn_cancels_the_call_on_the_server() -> None:
    probe = Probe()
    async with mcp_http(probe) as url:
        model = ScriptedModel([[Call("hang", {}, id="h")]])
        config = AgentConfig(mcp_servers=[MCPServerHTTP(url)], tool_timeout=600)
        async with Runtime(model=model, agent=config) as rt:
            turn = await rt.send("c", "go")
            with anyio.fail_after(20):
                await probe.hang_started.wait()
                assert await rt.cancel("c")
                await probe.hang_cancelled.wait()
            with pytest.raises(Exception, match="cancel"):
                await turn.result()


async def test_a_one_megabyte_result_becomes_an_artifact() -> None:
    probe = Probe()
    async with mcp_http(probe) as url:
        model = ScriptedModel([[Call("big", {}, id="b")], [Text("read it")]])
        async with Runtime(model=model, agent=AgentConfig(mcp_servers=[MCPServerHTTP(url)])) as rt:
            await (await rt.send("c", "go")).result()
            (result,) = await results(rt, "c")
            assert result.artifact is not None and result.full_size == BIG
            assert len(result.content) < 64 * 1024
            whole = await rt.store.get_artifact(result.artifact)
    assert whole is not None and len(whole) == BIG and whole.endswith(b"END")


async def test_list_changed_refreshes_the_tools_offered() -> None:
    probe = Probe()
    async with mcp_http(probe) as url:
        model = ScriptedModel([[Call("grow", {}, id="g")], [Text("grown")],
                               [Call("extra", {}, id="e")], [Text("done")]])
        async with Runtime(model=model, agent=AgentConfig(mcp_servers=[MCPServerHTTP(url)])) as rt:
            await (await rt.send("c", "grow")).result()
            (link,) = rt._mcp.links
            with anyio.fail_after(10):  # the notification is read after the call's answer
                await link.until(lambda link: link.version >= 2)
            await (await rt.send("c", "use it")).result()
            got = {r.call_id: r for r in await results(rt, "c")}
    assert "extra" not in {s.name for s in model.tool_specs[0]}
    assert "extra" in {s.name for s in model.tool_specs[2]}
    assert got["e"].content == "extra here" and not got["e"].is_error


async def test_clashing_names_are_prefixed_and_the_filter_keeps_a_subset() -> None:
    probe = Probe()

    @tool
    async def add(a: int, b: int) -> str:
        """A local add."""
        return "local"

    async with mcp_http(probe) as url:
        model = ScriptedModel([[Call("add", {"a": 1, "b": 2}, id="l"),
                                Call("one__add", {"a": 1, "b": 2}, id="r1"),
                                Call("two__big", {}, id="r2")], [Text("ok")]])
        config = AgentConfig(tools=[add], mcp_servers=[
            MCPServerHTTP(url, name="one", tool_filter={"add", "big"}),
            MCPServerHTTP(url, name="two", tool_filter=lambda n: n == "big"),
        ])
        async with Runtime(model=model, agent=config) as rt:
            await (await rt.send("c", "go")).result()
            got = {r.call_id: r for r in await results(rt, "c")}
            hub_links = rt._mcp.links
    names = {s.name for s in model.tool_specs[0]}
    assert {"add", "one__add", "one__big", "two__big"} <= names
    assert "hang" not in names and "one__hang" not in names  # filtered out
    assert got["l"].content == "local" and got["r1"].content == "3"
    assert got["r2"].full_size == BIG
    assert len(hub_links) == 1  # two configs of one server: one session


async def test_many_agents_share_one_session() -> None:
    probe = Probe()
    async with mcp_http(probe) as url:
        server = MCPServerHTTP(url)
        model = ScriptedModel([[Call("add", {"a": 1, "b": 1})], [Text("ok")]], loop=True)
        async with Runtime(model=model, agent=AgentConfig(mcp_servers=[server])) as rt:
            for i in range(20):  # one after another: the looping script is shared
                assert (await (await rt.send(f"c{i}", "go")).result()).text == "ok"
            (link,) = rt._mcp.links
            assert link.sessions == 1 and link.state == "ready"


async def test_a_server_that_is_down_gives_error_results() -> None:
    model = ScriptedModel([[Call("add", {"a": 1, "b": 1}, id="x")],
                           [Text("fine")]])
    down = MCPServerHTTP("http://127.0.0.1:9/mcp", name="down", connect_timeout=5)
    async with Runtime(model=model, agent=AgentConfig(mcp_servers=[down])) as rt:
        final = await (await rt.send("c", "go")).result()
        (result,) = await results(rt, "c")
    assert final.text == "fine"  # the turn went on
    assert result.is_error  # no tool of that name was ever listed: unknown
