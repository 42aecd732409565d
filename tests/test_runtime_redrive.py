"""Issue 20, item 3, on one node: a restart runs what a killed process left owing.

A process killed with SIGKILL while a turn streams, after it acknowledged a
second message as postponed: the next runtime on the same file logs
``Aborted(interrupted)`` for the cut turn and answers the postponed message by
itself, with no new request (``torpor.runtime.redrive``, from the store's
open-work index). Conversations that owe nothing, wait for an outside answer or
are parked are not woken; one with only an abort owed is hibernated again.
"""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Sequence
from pathlib import Path

import anyio
from test_runtime_crash import run_child_until_streaming_then_kill

from torpor import (
    Aborted,
    AssistantMessage,
    EchoModel,
    Event,
    Parked,
    Runtime,
    RuntimeConfig,
    Suspended,
    ToolCall,
    UserMessage,
)
from torpor.events import Body, aborted_body
from torpor.store import SQLiteStore

CHILD = textwrap.dedent(
    """
    import sys, anyio, logging, structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    from torpor import Runtime, ScriptedModel
    from torpor.llm import Signal, Text, Wait

    async def main() -> None:
        reached, never = anyio.Event(), anyio.Event()
        model = ScriptedModel([[Text("half an answ"), Signal(reached), Wait(never)]])
        async with Runtime(sys.argv[1], model=model) as rt:
            await rt.send("c", "question one")
            await reached.wait()
            second = await rt.send("c", "question two")
            assert second.postponed
            print("postponed", flush=True)
            await never.wait()

    anyio.run(main)
    """
)


async def logged_until_answered(
    rt: Runtime, conversation: str, after: int, turn: int
) -> list[Event]:
    """Follow the log (which never wakes an agent) until ``turn`` is answered."""
    events: list[Event] = []
    async with rt.subscribe(conversation, after=after) as follower:
        async for item in follower:
            if isinstance(item, Event):
                events.append(item)
                body = item.body
                if isinstance(body, AssistantMessage) and item.turn == turn and not body.tool_calls:
                    return events
    raise AssertionError(f"the follower ended before turn {turn} was answered: {events}")


async def test_a_restart_answers_what_a_killed_process_acknowledged_with_no_new_request(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path}/k.db"
    run_child_until_streaming_then_kill(url, CHILD, "postponed")
    async with SQLiteStore(str(tmp_path / "k.db")) as store:
        left = await store.read_since("c", 0)
    assert [(e.turn, e.body) for e in left] == [
        (1, UserMessage("question one")), (2, UserMessage("question two"))
    ]
    async with Runtime(url, model=EchoModel()) as rt:
        with anyio.fail_after(30):
            settled = await logged_until_answered(rt, "c", after=1, turn=2)
        assert await rt.store.open_work() == []
    aborted, answer = settled
    assert isinstance(aborted.body, Aborted) and aborted.body.reason == "interrupted"
    assert aborted.turn == 1 and aborted.position == 2
    assert answer.body == AssistantMessage("echo: question two") and answer.position == 3


async def write(path: Path, logs: dict[str, Sequence[tuple[int, Body]]]) -> None:
    """Logs as a process that died left them (the store, not a runtime)."""
    async with SQLiteStore(str(path)) as store:
        for conversation, steps in logs.items():
            for turn, body in steps:
                await store.append(conversation, [body], turn=turn)


ASKS = AssistantMessage("needs approval", (ToolCall("a1", "deploy"),))


async def redriven(rt: Runtime) -> None:
    """Until the runtime's re-drive runs have ended (they started with it)."""
    runs = list(rt._redrive._runs)
    assert runs, "a starting runtime re-drives"
    await asyncio.gather(*runs)


async def test_only_conversations_owing_a_run_are_woken_and_those_with_none_left_hibernate(
    tmp_path: Path,
) -> None:
    path = tmp_path / "k.db"
    await write(path, {
        "cut": [(1, UserMessage("x"))],
        "answered": [(1, UserMessage("x")), (1, AssistantMessage("y"))],
        "waiting": [(1, UserMessage("x")), (1, ASKS), (1, Suspended(("a1",))),
                    (2, UserMessage("behind the approval"))],
        "parked": [(1, UserMessage("x")), (1, Aborted("crashed")), (2, UserMessage("y")),
                   (2, Parked("boom", 3))],
    })
    async with Runtime(f"sqlite:///{path}", model=EchoModel()) as rt:
        with anyio.fail_after(30):
            await redriven(rt)
        infos = {c: await rt.admin.inspect(c) for c in ("cut", "answered", "waiting", "parked")}
        assert [c for c, info in infos.items() if info.live] == ["cut"]  # the others: asleep
        assert infos["cut"].hibernated and infos["cut"].working_set_bytes == 0
        cut = await rt.store.read_since("cut", 0)
        assert isinstance(cut[-1].body, Aborted) and cut[-1].body.reason == "interrupted"
        for untouched, length in (("answered", 2), ("waiting", 4), ("parked", 4)):
            assert len(await rt.store.read_since(untouched, 0)) == length
        assert await rt.store.open_work() == []


async def test_the_live_agent_cap_holds_while_many_conversations_are_re_driven(
    tmp_path: Path,
) -> None:
    path = tmp_path / "k.db"
    names = [f"c{i}" for i in range(12)]
    await write(path, {n: [(1, UserMessage("x")), (2, UserMessage("y"))] for n in names})
    config = RuntimeConfig(max_live_agents=3)
    peak = 0
    async with Runtime(f"sqlite:///{path}", model=EchoModel(), config=config) as rt:
        with rt.admin.watch() as changes, anyio.fail_after(60):
            while await rt.store.open_work():
                peak = max(peak, (await rt.admin.stats()).live)
                await anext(changes)
        for name in names:
            bodies = [e.body for e in await rt.store.read_since(name, 0)]
            assert bodies[2:] == [aborted_body("interrupted", detail="found unfinished on revival"),
                                  AssistantMessage("echo: y")]
    assert 0 < peak <= 3
