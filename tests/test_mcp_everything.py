"""The official reference server (npm ``@modelcontextprotocol/server-everything``) over stdio
and streamable HTTP, and a Python MCP server over stdio that dies mid-call."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest

pytest.importorskip("mcp")

from npm_packages import NpmUnavailable, mcp_everything

from torpor import AgentConfig, Runtime, ScriptedModel
from torpor.events import ToolResult
from torpor.llm import Call, Text
from torpor.mcp import MCPServerHTTP, MCPServerStdio

HERE = Path(__file__).parent


def everything() -> Path:
    try:
        return mcp_everything()
    except NpmUnavailable as exc:
        if os.environ.get("TORPOR_REQUIRE_NPM"):
            raise
        pytest.skip(str(exc))


async def results(rt: Runtime, conversation_id: str) -> dict[str, ToolResult]:
    events = await rt.store.read_since(conversation_id, 0)
    return {e.body.call_id: e.body for e in events if isinstance(e.body, ToolResult)}


def two_calls() -> ScriptedModel:
    return ScriptedModel([[Call("echo", {"message": "hello mcp"}, id="e"),
                           Call("get-sum", {"a": 19, "b": 23}, id="s")],
                          [Text("echoed, and the sum is 42")]])


async def test_an_agent_answers_a_turn_calling_two_server_everything_tools_over_stdio() -> None:
    model = two_calls()
    server = MCPServerStdio("node", [str(everything()), "stdio"], name="everything")
    async with Runtime(model=model, agent=AgentConfig(mcp_servers=[server])) as rt:
        final = await (await rt.send("c", "echo, then add")).result()
        got = await results(rt, "c")
    assert final.text == "echoed, and the sum is 42"
    assert got["e"].content == "Echo: hello mcp" and not got["e"].is_error
    assert "42" in got["s"].content and not got["s"].is_error
    # The model read both results in its second call.
    second = str(model.calls[1])
    assert "Echo: hello mcp" in second and "42" in second


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def everything_http() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        ["node", str(everything()), "streamableHttp"], env={**os.environ, "PORT": str(port)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stderr is not None
        for line in process.stderr:  # it says so once it listens
            if "listening on port" in line:
                break
        else:
            pytest.fail("server-everything did not start")
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.kill()
        process.wait()


async def test_server_everything_over_streamable_http() -> None:
    model = two_calls()
    with everything_http() as url:
        config = AgentConfig(mcp_servers=[MCPServerHTTP(url, name="everything")])
        async with Runtime(model=model, agent=config) as rt:
            final = await (await rt.send("c", "echo, then add")).result()
            got = await results(rt, "c")
    assert final.text == "echoed, and the sum is 42"
    assert got["e"].content == "Echo: hello mcp"
    assert "42" in got["s"].content


async def test_an_image_is_summarized_with_its_size() -> None:
    model = ScriptedModel([[Call("get-tiny-image", {}, id="i")], [Text("seen")]])
    server = MCPServerStdio("node", [str(everything()), "stdio"])
    async with Runtime(model=model, agent=AgentConfig(mcp_servers=[server])) as rt:
        await (await rt.send("c", "show me")).result()
        got = await results(rt, "c")
    assert "[image content: image/png," in got["i"].content and "bytes]" in got["i"].content
    assert len(got["i"].content) < 1000  # no base64 in the model's context


async def test_a_server_killed_mid_call_gives_an_error_and_is_restarted() -> None:
    model = ScriptedModel([[Call("pid", {}, id="p1")], [Call("die", {}, id="d")],
                           [Text("survived")], [Call("pid", {}, id="p2")], [Text("again")]])
    server = MCPServerStdio(sys.executable, [str(HERE / "mcp_servers.py")], name="py",
                            env={"PYTHONPATH": os.pathsep.join(sys.path)})
    config = AgentConfig(mcp_servers=[server], tool_timeout=30)
    async with Runtime(model=model, agent=config) as rt:
        first = await (await rt.send("c", "go")).result()
        (link,) = rt._mcp.links
        with anyio.fail_after(30):  # restarted in the background, after the backoff
            await link.until(lambda link: link.sessions == 2 and link.state == "ready")
        second = await (await rt.send("c", "again")).result()
        got = await results(rt, "c")
        sessions = link.sessions
    assert first.text == "survived"  # the turn went on past the dead server
    assert got["d"].is_error and "connection closed" in got["d"].content
    assert second.text == "again"
    assert not got["p2"].is_error and got["p2"].content != got["p1"].content  # a new process
    assert sessions == 2
