"""Committing an answer: the follower seam before it is applied, its audit row, bad rows."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import anyio
import pytest

import torpor
from torpor import (
    AssistantMessage,
    CorruptEvent,
    Runtime,
    ScriptedModel,
    TextDelta,
    UserMessage,
)
from torpor.actors.stream import StreamItem
from torpor.llm import Signal, Text, Wait
from torpor.store import ModelCall, open_store


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


async def test_an_audit_row_whose_body_is_not_a_blob_is_a_corrupt_event(tmp_path: Path) -> None:
    """SQLite keeps whatever type a row was given: a body stored as TEXT (or an integer)
    must read as CorruptEvent, as an event's body does, not as a TypeError."""
    call = ModelCall("c", 1, 0, 0, b"", "ab", {"system": 1}, 1, 0.5)
    async with open_store(db(tmp_path)) as store:
        await store.append("c", [UserMessage("x")])  # only an append creates a conversation
        await store.record_model_call(call)
    with sqlite3.connect(tmp_path / "log.db") as conn:
        conn.execute("UPDATE model_calls SET body = 'not msgpack'")
    async with open_store(db(tmp_path)) as store:
        with pytest.raises(CorruptEvent):
            await store.model_calls("c")
    with sqlite3.connect(tmp_path / "log.db") as conn:
        conn.execute("UPDATE model_calls SET body = 7")
    async with open_store(db(tmp_path)) as store:
        with pytest.raises(CorruptEvent):
            await store.model_calls("c")


@pytest.mark.parametrize("recipe", [b"", b"\xc1", b"\x93\x01\x02\x03", b"\xde\x00\x00"])
async def test_rendered_of_a_call_whose_recipe_does_not_decode_is_a_corrupt_event(
    tmp_path: Path, recipe: bytes
) -> None:
    """admin.rendered (and the admin endpoint over it) decodes the recipe stored in an
    audit row: a recipe that does not decode is the store's corruption, a typed error."""
    async with Runtime(db(tmp_path), model=ScriptedModel.replies("a")) as rt:
        await (await rt.send("c", "hi")).result()
        await rt.store.record_model_call(ModelCall("c", 1, 5, 0, recipe, "ab", {}, 1, 0.5))
        with pytest.raises(CorruptEvent):
            await rt.admin.rendered("c", -1)
        assert (await rt.admin.rendered("c", 0)).matches  # the sound row still rebuilds


async def test_a_model_call_whose_answer_conflicts_still_leaves_its_audit_row(
    tmp_path: Path,
) -> None:
    """Every model call writes a model_calls row (DESIGN): the provider was called and
    paid. An answer that conflicts with a second writer is not logged (the actor crashes
    and revives from the log), but the call it cost is still on record."""
    streamed, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("Al"), Signal(streamed), Wait(go), Text("pha")], [Text("b")]])
    async with Runtime(db(tmp_path), model=model) as rt:
        turn = await rt.send("c", "first")
        await streamed.wait()
        await rt.store.append_events("c", [UserMessage("a second writer")], turn=1)
        go.set()
        with pytest.raises(torpor.TurnAborted):
            await turn.result()
        calls = await rt.store.model_calls("c")
    assert [(c.turn, c.purpose) for c in calls] == [(1, "turn")], calls
