"""Review of the hot-path changes (rev5): the seams they opened, each pinned by a test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import torpor
from torpor import AssistantMessage, Runtime, ScriptedModel, TextDelta, UserMessage
from torpor.actors.stream import StreamItem
from torpor.llm import Signal, Text, Wait


def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'log.db'}"


async def test_a_follower_after_a_mid_turn_message_not_yet_applied_gets_all_the_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """subscribe(after=p): p a user message sent mid-turn, committed, its sender not yet
    back. The answer streaming meanwhile is not in the log: its text so far is still in
    flight, and the follower must get it before the rest (else the deltas it shows for
    that answer lack their start)."""
    streamed, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("Al"), Signal(streamed), Wait(go), Text("pha")], [Text("b")]])
    async with Runtime(db(tmp_path), model=model) as rt:
        committed, release = anyio.Event(), anyio.Event()
        append = rt.store.append_events

        async def commit_slowly(*args: Any, **kwargs: Any) -> list[torpor.Event]:
            events: list[torpor.Event] = await append(*args, **kwargs)
            if isinstance(events[0].body, UserMessage) and events[0].body.text == "mid":
                committed.set()  # durable; the sender has not applied it (head unchanged)
                await release.wait()
            return events

        monkeypatch.setattr(rt.store, "append_events", commit_slowly)
        turn = await rt.send("c", "first")
        await streamed.wait()  # "Al" is in flight
        async with anyio.create_task_group() as tg:
            tg.start_soon(rt.send, "c", "mid")
            await committed.wait()
            after = await rt.store.head("c")
            assert after is not None and after > rt._registry.get("c").head  # type: ignore[union-attr]
            follower = rt.subscribe("c", after=after)
            go.set()
            release.set()
        assert (await turn.result()).text == "Alpha"
        seen: list[StreamItem] = []
        with anyio.fail_after(10):
            async for item in follower:
                seen.append(item)
                if isinstance(item, torpor.Event) and isinstance(item.body, AssistantMessage):
                    break
        follower.close()
    text = "".join(i.text for i in seen if isinstance(i, TextDelta))
    assert text == "Alpha", seen
