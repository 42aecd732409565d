"""A runtime process killed with SIGKILL mid-turn: the next process finds the log consistent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio

from torpor import Aborted, AssistantMessage, EchoModel, Event, Runtime, UserMessage
from torpor.store import SQLiteStore

CHILD = textwrap.dedent(
    """
    import sys, anyio, logging, structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    from torpor import Runtime, ScriptedModel
    from torpor.llm import Signal, Text, Wait

    async def main() -> None:
        reached, never = anyio.Event(), anyio.Event()
        model = ScriptedModel([[Text("first answer")],
                               [Text("half of the sec"), Signal(reached), Wait(never)]])
        async with Runtime(sys.argv[1], model=model) as rt:
            await (await rt.send("c", "question one")).result()
            await rt.send("c", "question two")
            await reached.wait()
            print("streaming", flush=True)
            await never.wait()

    anyio.run(main)
    """
)


def run_child_until_streaming_then_kill(
    url: str, code: str = CHILD, line: str = "streaming"
) -> None:
    """Blocking on purpose: the child's ``line`` is the synchronisation point, then SIGKILL."""
    child = subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == line
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()


async def test_sigkill_mid_stream_leaves_a_log_the_next_process_completes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/k.db"
    run_child_until_streaming_then_kill(url)
    async with SQLiteStore(url.removeprefix("sqlite:///")) as store:
        before = await store.read_since("c", 0)
    assert [type(e.body) for e in before] == [UserMessage, AssistantMessage, UserMessage]
    async with Runtime(url, model=EchoModel()) as rt:
        # The new process settles the cut turn by itself (re-drive, issue 20): its Aborted
        # comes with no request. Following the log wakes nothing.
        with anyio.fail_after(30):
            async with rt.subscribe("c", after=2) as follower:
                logged = await anext(e async for e in follower if isinstance(e, Event))
        assert isinstance(logged.body, Aborted) and logged.position == 3
        final = await (await rt.send("c", "are you back?")).result()
        assert final.text == "echo: are you back?"
        after = list(reversed(await rt.history("c")))
        aborted = after[3].body
        assert isinstance(aborted, Aborted) and aborted.reason == "interrupted"
        assert after[3].turn == 2 and after[4].turn == 3
        assert [e.position for e in after] == list(range(6))
