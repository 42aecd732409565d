"""Runtime.delete, Runtime.conversations and titles over a real store (runtime.erase).

A deleted conversation leaves nothing in the store, its followers' streams end with
ConversationDeleted, and sends racing the delete either landed before it (and went
with it) or fail with UnknownConversation: none brings any of it back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from torpor import ConversationDeleted, Runtime, UnknownConversation
from torpor.events import UserMessage


async def test_delete_stops_agent_ends_followers_and_lists_nothing(tmp_path: Path) -> None:
    async with Runtime(f"sqlite:///{tmp_path / 'rt.db'}") as rt:
        turn = await rt.send("c", "first message here")
        await turn.result()
        await (await rt.send("c/child", "a sub conversation")).result()
        await (await rt.send("other", "keep me")).result()
        page = await rt.conversations()
        assert {i.id for i in page} == {"c", "c/child", "other"}
        assert {i.id: i.title for i in page}["c"] == "first message here"
        assert await rt.set_title("c", "Renamed")
        assert await rt.set_metadata("c", {"owner": "u1"})
        info = (await rt.conversations(prefix="c")).items
        assert [(i.id, i.title, i.metadata) for i in info if i.id == "c"] == [
            ("c", "Renamed", {"owner": "u1"})
        ]
        follower = rt.subscribe("c", after=-1)
        assert await rt.delete("c") is True
        with pytest.raises(ConversationDeleted):
            async for _ in follower:
                pass
        # "c/child" was never spawned by "c" (no link in its log): not a sub-agent, kept.
        assert {i.id for i in await rt.conversations()} == {"other", "c/child"}
        assert await rt.history("c") == []
        assert await rt.delete("c") is False
        assert await rt.delete("never-was") is False
        assert not await rt.set_title("c", "x")
        # The id is free again: a new, empty conversation.
        await (await rt.send("c", "hello again")).result()
        assert [e.position for e in reversed(await rt.history("c"))] == [0, 1]


async def test_sends_racing_a_delete_never_resurrect_it(tmp_path: Path) -> None:
    async with Runtime(f"sqlite:///{tmp_path / 'rt.db'}") as rt:
        for index in range(3):
            await (await rt.send("c", f"old-{index}")).result()

        async def send(index: int) -> str:
            try:
                turn = await rt.send("c", f"race-{index}")
            except UnknownConversation:
                return "refused"
            try:
                await turn.result()
            except Exception:
                return "logged"  # in the log before the delete; its turn ended by it
            return "answered"

        sends = [asyncio.ensure_future(send(i)) for i in range(8)]
        await asyncio.sleep(0)  # let some of them reach the agent first (any order holds)
        deleting = asyncio.ensure_future(rt.delete("c"))
        sends += [asyncio.ensure_future(send(i)) for i in range(8, 16)]
        outcomes = await asyncio.gather(*sends)
        assert await deleting is True
        texts = [
            e.body.text for e in await rt.store.read_since("c", 0)
            if isinstance(e.body, UserMessage)
        ]
        assert not [t for t in texts if t.startswith("old-")]  # nothing before survived
        events = await rt.store.read_since("c", 0)
        if events:  # a send after the delete returned: a fresh conversation from 0
            assert events[0].position == 0 and isinstance(events[0].body, UserMessage)
        assert "refused" in outcomes or "logged" in outcomes or events
