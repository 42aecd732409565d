"""Turn numbers: each user message gets its own, in log order, however commits interleave.

Issue 19, item 1: ``Runtime.send`` logged a message sent mid-turn from the
caller's task (``postpone``), numbering it under the agent's write lock, while
the actor's ``_handle_send`` numbered a message it took from its mailbox
*before* taking the lock. A turn ending while the postponed write was in
flight, and a second send reaching the actor meanwhile, gave both messages
one turn number; the agent then crash-looped and was parked. The interleaving
is forced here with gates on the real store's writes (tests/held_writes.py),
on SQLite and on PostgreSQL: no sleeps, no timing.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
from held_writes import HeldWrites, Write
from store_backends import Backend

from torpor import AssistantMessage, EchoModel, Parked, Runtime, Turn, UserMessage
from torpor.errors import AgentParked


def url_of(backend: Backend) -> str:
    return f"sqlite:///{backend.location}" if backend.name == "sqlite" else str(backend.location)


def user_write(text: str) -> Any:
    return lambda w: text in w.user_texts


def answer_write(w: Write) -> bool:
    return w.answer


async def answer(turn: Turn) -> str:
    result = await turn.result()
    assert isinstance(result, AssistantMessage), result
    return result.text


async def check_turns(rt: Runtime, cid: str) -> list[tuple[int, int, str]]:
    """(position, turn, text) of every user message; each turn its own, rising with position."""
    events = await rt.store.read_since(cid, 0)
    users = [(e.position, e.turn, e.body.text) for e in events if isinstance(e.body, UserMessage)]
    turns = [turn for _, turn, _ in users]
    assert turns == sorted(set(turns)), f"turn numbers repeat or fall: {users}"
    assert not [e for e in events if isinstance(e.body, Parked)], "the log parks the agent"
    return users


async def test_a_send_while_a_postponed_write_is_in_flight_gets_its_own_turn(
    backend: Backend,
) -> None:
    """Hold the answer's commit, send A (postponed behind the open turn; hold its write),
    let the answer commit (the turn ends), send B (through the mailbox), then let A's
    write commit: A and B are two turns, both answered, nothing parked."""
    async with Runtime(url_of(backend), model=EchoModel()) as rt:
        with HeldWrites(rt.store) as writes:
            answer_commit = writes.hold(answer_write, after=True)  # committed, the actor not back
            a_write = writes.hold(user_write("A"))
            first = await rt.send("c", "first")
            with anyio.fail_after(10):
                await answer_commit.reached.wait()
            turns: dict[str, Turn] = {}

            async def send(text: str) -> None:
                turns[text] = await rt.send("c", text)

            async with anyio.create_task_group() as tg:
                tg.start_soon(send, "A")
                await anyio.wait_all_tasks_blocked()  # A is on its way while the turn is open
                answer_commit.release()
                with anyio.fail_after(10):
                    await a_write.reached.wait()  # A's write is in flight
                # Nothing else to wait for: the turn ends (the old code's actor then waits
                # for mail; not awaited here, so an actor that ends it later is not stuck).
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(send, "B")
                await anyio.wait_all_tasks_blocked()  # B reached the agent, A still in flight
                a_write.release()
            a, b = turns["A"], turns["B"]
            assert a.number != b.number, f"A and B were both given turn {a.number}"
            with anyio.fail_after(10):
                assert await answer(first) == "echo: first"
                for text, turn in (("A", a), ("B", b)):
                    assert await answer(turn) == f"echo: {text}"
            with anyio.fail_after(10):  # still serving
                assert await answer(await rt.send("c", "after")) == "echo: after"
        texts = [text for _, _, text in await check_turns(rt, "c")]
        # A and B were in flight together: either may be logged first
        assert texts[0] == "first" and sorted(texts[1:3]) == ["A", "B"] and texts[3:] == ["after"]
        info = await rt.admin.inspect("c")
        assert info.state != "parked" and info.parked_cause is None
        stats = await rt.admin.stats()
        assert (stats.crashes, stats.parks) == (0, 0)


@pytest.mark.parametrize("answered", [True, False], ids=["B-answered", "none-answered"])
async def test_a_log_with_two_user_messages_in_one_turn_revives_and_answers(
    backend: Backend, answered: bool
) -> None:
    """What the race above left behind (A and B logged with one turn number; B's turn
    answered, or the process gone before any answer) must not crash-loop the agent once
    reopened: a new message is answered and nothing is parked."""
    url = url_of(backend)
    async with Runtime(url, model=EchoModel()) as rt:
        assert await answer(await rt.send("c", "first")) == "echo: first"
        store = rt.store
        head = await store.head("c")
        assert head is not None
        # As the old code logged them: A postponed as turn 2, then B taken as turn 2 too.
        await store.append_events("c", [UserMessage("A")], turn=2, expect_head=head)
        await store.append_events("c", [UserMessage("B")], turn=2, expect_head=head + 1)
        if answered:
            await store.append_events("c", [AssistantMessage("echo: B")], turn=2,
                                      expect_head=head + 2)
    async with Runtime(url, model=EchoModel()) as rt:
        try:
            with anyio.fail_after(10):
                turn = await rt.send("c", "again")
                result = await turn.result()
        except AgentParked as exc:
            raise AssertionError(f"the agent was parked: {exc}") from None
        assert isinstance(result, AssistantMessage) and result.text == "echo: again"
        assert turn.number > 2  # after every turn the log holds
        info = await rt.admin.inspect("c")
        assert info.state != "parked" and info.parked_cause is None
        stats = await rt.admin.stats()
        assert (stats.crashes, stats.parks) == (0, 0)
        events = await rt.store.read_since("c", 0)
        assert not [e for e in events if isinstance(e.body, Parked)]
