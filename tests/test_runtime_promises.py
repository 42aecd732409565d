"""Issue 8 through the real runtime: the promises a caller builds on.

Each test here fails when the fix it names is taken out: postponed sends and
the mailbox bound (item 1), a turn's stream ending at a suspension (item 2),
``subscribe(after=)`` with no gap and no duplicate at any seam (item 3),
``cancel`` racing the final commit (item 4), the admin's calling convention
and the runtime's public face (item 13), pending approvals (item 14).

Real SQLite files throughout; synchronisation through ScriptedModel's
Signal/Wait steps, anyio events and ``wait_all_tasks_blocked``, never sleeps.
"""

from __future__ import annotations

from pathlib import Path

import anyio

import torpor
from torpor import (
    Busy,
    Runtime,
    RuntimeConfig,
    ScriptedModel,
    UserMessage,
)
from torpor.llm import Text, Wait


def db(tmp_path: Path, name: str = "log.db") -> str:
    return f"sqlite:///{tmp_path / name}"


async def log_of(rt: Runtime, conv: str) -> list[torpor.Event]:
    return list(reversed(await rt.history(conv, limit=10_000)))


# -- item 1: the bound applies to sends being logged behind an open turn ------------------


async def test_concurrent_sends_behind_a_streaming_turn_respect_the_mailbox_bound(
    tmp_path: Path,
) -> None:
    go = anyio.Event()
    model = ScriptedModel([[Wait(go), Text("a")], [Text("b")]])
    config = RuntimeConfig(mailbox_bound=1)
    async with Runtime(db(tmp_path), model=model, config=config) as rt:
        first = await rt.send("c", "1")
        outcomes: dict[str, object] = {}

        async def send(text: str) -> None:
            try:
                outcomes[text] = await rt.send("c", text)
            except Busy as exc:
                outcomes[text] = exc

        async with anyio.create_task_group() as tg:
            # Both start before either write completes: the second must see the first.
            tg.start_soon(send, "2")
            tg.start_soon(send, "3")
        assert isinstance(outcomes["2"], torpor.Turn) and outcomes["2"].postponed
        assert isinstance(outcomes["3"], Busy)
        go.set()
        await first.result()
        assert (await outcomes["2"].result()).text == "b"
        texts = [e.body.text for e in await log_of(rt, "c") if isinstance(e.body, UserMessage)]
        assert texts == ["1", "2"]
