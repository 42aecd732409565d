"""1,000 agents sharing one MCP server: one session, one child process.

Each of ``--agents`` conversations runs a turn that calls server-everything's ``echo``
tool over stdio (``--concurrency`` turns at a time) and then answers with what the tool
said. Printed: the MCP sessions the runtime opened, the child processes this process has
(the stdio server and anything it started), this process's RSS and the server's, and
turns per second.

Needs node, npm and the mcp package: ``python bench/mcp_sessions.py [--agents 1000]
[--concurrency 100]`` (the server is installed by ``tests/npm_packages.py`` into its
cache on first use).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from npm_packages import mcp_everything

from torpor import AgentConfig, Runtime
from torpor.events import ToolCall, ToolResult
from torpor.llm.protocol import ContextMessage, StreamEvent, TextDelta, ToolCallDelta
from torpor.mcp import MCPServerStdio


class EchoCaller:
    """Calls ``echo`` once per turn, then answers with the tool's result."""

    name = "echo-caller"

    async def stream(
        self, messages: Sequence[ContextMessage], tools: Sequence[Any]
    ) -> AsyncIterator[StreamEvent]:
        last = messages[-1]
        if isinstance(last, ToolResult):
            yield TextDelta(f"the tool said: {last.content}")
            return
        yield ToolCallDelta(ToolCall("echo-1", "echo", {"message": "ping"}))


def children(pid: int) -> list[int]:
    """Every descendant process of ``pid`` (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found.extend(kids)
        frontier.extend(kids)
    return found


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def main(agents: int, concurrency: int) -> None:
    server = MCPServerStdio("node", [str(mcp_everything()), "stdio"], name="everything")
    config = AgentConfig(mcp_servers=[server], recall_tools=False)
    before = rss_mib(os.getpid())
    async with Runtime("sqlite://", model=EchoCaller(), agent=config) as rt:  # type: ignore[arg-type]
        gate = asyncio.Semaphore(concurrency)
        answers: list[str] = []

        async def one(i: int) -> None:
            async with gate:
                final = await (await rt.send(f"agent-{i}", "call echo")).result()
                answers.append(getattr(final, "text", ""))

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(agents)))
        seconds = time.perf_counter() - started
        links = rt._mcp.links
        kids = children(os.getpid())
        ours = rss_mib(os.getpid())
        server_rss = sum(rss_mib(p) for p in kids)
        good = sum(a == "the tool said: Echo: ping" for a in answers)
        print(f"agents: {agents} (concurrency {concurrency}), turns answered with the tool's "
              f"result: {good}")
        print(f"MCP sessions opened: {sum(link.sessions for link in links)} "
              f"(links: {len(links)})")
        print(f"child processes: {len(kids)} ({', '.join(map(str, kids))})")
        print(f"RSS: this process {ours:.1f} MiB ({ours - before:+.1f} MiB over the "
              f"start), the MCP server {server_rss:.1f} MiB")
        print(f"{agents / seconds:.0f} turns/s ({seconds:.2f} s)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=100)
    args = parser.parse_args()
    asyncio.run(main(args.agents, args.concurrency))
