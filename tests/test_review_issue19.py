"""Review of issue 19 (the actor as the only writer): findings and mutation checks.

Two kinds of test live here.

* Findings: each shows a promise of DESIGN.md "The actor" that the code on
  ``lead`` breaks (a request or a turn left unanswered, a dead turn still
  writing). They fail until the bug is fixed.
* Mutation checks: each fails when one feature of the redesign is removed (named
  in its docstring) and passes with it; no other test notices that removal.

No sleeps as synchronisation and no decision by elapsed time: interleavings are
forced with held store writes (tests/held_writes.py), scripted models that wait
for the test, the admin watch feed and ``wait_all_tasks_blocked``;
``fail_after`` is only a hang guard.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from held_writes import HeldWrites, Write
from support import until

from torpor import (
    Aborted,
    AgentConfig,
    AgentParked,
    AssistantMessage,
    ConflictError,
    EchoModel,
    ExternalTool,
    Parked,
    Runtime,
    RuntimeClosed,
    RuntimeConfig,
    ShardMoved,
    Suspended,
    Turn,
    TurnAborted,
    Unparked,
    UserMessage,
)
from torpor.actors.agent import Agent, Host, Profile
from torpor.actors.state import AgentState, InvalidTransition
from torpor.actors.tools import Toolbox
from torpor.llm.scripted import Call, ScriptedModel, Signal, Text, Wait


def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'log.db'}"


def user_write(text: str) -> Callable[[Write], bool]:
    return lambda w: text in w.user_texts


def turn_tasks() -> list[asyncio.Task[Any]]:
    """Turn tasks (``actor._run_turn``) still running in this loop."""
    return [
        t for t in asyncio.all_tasks()
        if not t.done() and getattr(t.get_coro(), "__qualname__", "") == "_run_turn"
    ]


def ends(events: list[Any], turn: int) -> list[str]:
    """How the log ends ``turn``: its answers and aborts, in position order."""
    out = []
    for e in events:
        if e.turn != turn:
            continue
        if isinstance(e.body, Aborted):
            out.append(f"aborted:{e.body.reason}")
        elif isinstance(e.body, AssistantMessage) and not e.body.tool_calls:
            out.append("answer")
    return out


# -- findings ----------------------------------------------------------------------------


async def test_an_actor_that_crashes_while_its_turn_runs_leaves_no_turn_writing(
    tmp_path: Path,
) -> None:
    """Finding 1. The actor raises while its turn task runs (here: a card change meets a
    conflict, because something else wrote the log). ``run_agent`` lets the exception out
    without cancelling or awaiting ``agent.turn_task``, and the next task's ``_recover``
    only drops the reference: the turn task keeps running beside the revived actor. The
    revival logs ``Aborted(interrupted)`` for the turn and its caller is told "crashed",
    then the orphan logs the turn's answer after that abort, through the new actor's
    lock and head (and would finish and clear whatever turn the new actor runs)."""
    go, streaming = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("a"), Signal(streaming), Wait(go), Text("b")], "second"])
    config = RuntimeConfig(backoff_initial=0.0)
    async with Runtime(db(tmp_path), model=model, config=config) as rt:
        first = await rt.send("c", "one")
        with anyio.fail_after(10):
            await streaming.wait()
        head = await rt.store.head("c")
        await rt.store.append_events("c", [Unparked()], turn=first.number, expect_head=head)
        with rt.admin.watch() as watcher:
            with pytest.raises(ConflictError):
                await rt.task("c").update(goal="g")  # the actor's write conflicts: it crashes
            with pytest.raises(TurnAborted):
                await first.result()
            await until(watcher, "c", "awaiting_input", old="reviving")
        orphans = turn_tasks()
        go.set()  # let an orphan go on, to show what it does
        if orphans:
            await asyncio.wait(orphans)
        events = await rt.store.read_since("c", 0)
        assert ends(events, first.number) == ["aborted:interrupted"], (
            "the turn was ended in the log and then written to by a task nobody owns"
        )
        assert not orphans, "the crashed actor's turn task still runs beside its successor"


async def test_every_request_to_hibernate_is_answered(tmp_path: Path) -> None:
    """Finding 2. Two requests to hibernate (two operators, or the sweep and an operator)
    are both in the mailbox; the actor answers the first, drops its caches and returns.
    The second stays in the mailbox (a hibernate request is not "work", so nothing
    starts a task for it): its ``admin.hibernate`` waits until some later request to
    the conversation happens to wake the agent."""
    async with Runtime(db(tmp_path), model=EchoModel()) as rt:
        await (await rt.send("c", "hello")).result()
        first = asyncio.ensure_future(rt.admin.hibernate("c"))
        second = asyncio.ensure_future(rt.admin.hibernate("c"))
        with anyio.fail_after(10):
            assert await first is True
        await anyio.wait_all_tasks_blocked()
        answered = second.done()
        if not answered:  # unblock it so the runtime can close: a send wakes the agent
            await (await rt.send("c", "wake up")).result()
            await second
        assert answered, "the second hibernate request was never answered"


async def test_a_parked_conversation_waiting_for_a_slot_refuses_input(tmp_path: Path) -> None:
    """Finding 3. Over ``max_live_agents`` a send goes through the admission queue, which
    logs the message without asking whether the conversation is parked: a parked
    conversation takes input into its log (DESIGN: it refuses input until unparked), and
    once a slot frees its actor revives parked, refuses its mailbox and returns, but the
    postponed turn's handle is never completed (until the runtime stops)."""
    url = db(tmp_path)
    async with Runtime(url, model=EchoModel()) as rt:
        await (await rt.send("p", "hello")).result()
        head = await rt.store.head("p")
        await rt.store.append_events("p", [Parked("crash loop", restarts=5)], turn=1,
                                     expect_head=head)
    go, streaming = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("x"), Signal(streaming), Wait(go)]])
    async with Runtime(url, model=model, config=RuntimeConfig(max_live_agents=1)) as rt:
        busy = await rt.send("a", "busy")  # holds the only slot
        with anyio.fail_after(10):
            await streaming.wait()
        with rt.admin.watch() as watcher:
            try:
                turn: Turn | None = await rt.send("p", "while parked")
            except AgentParked:
                turn = None
            go.set()
            with anyio.fail_after(10):
                await busy.result()
            if turn is not None:  # let in once "a" idles: it revives parked
                await until(watcher, "p", "parked")
                await anyio.wait_all_tasks_blocked()
        events = await rt.store.read_since("p", 0)
        logged = [e.body.text for e in events if isinstance(e.body, UserMessage)]
        assert turn is None or turn.done(), "the turn of a message sent while parked never ends"
        assert logged == ["hello"], "a parked conversation took input into its log"


async def test_a_send_to_a_queued_conversation_in_flight_at_shutdown_is_settled(
    tmp_path: Path,
) -> None:
    """Finding 4. ``Admission.close`` (the runtime stopping) fails the postponed turns of
    the queued records it holds and forgets the queue, but an ``Admission.send`` whose
    write is in flight then adds its postponed turn to a record nobody will run or
    stop: the caller gets a Turn that never ends, and the log holds the message with no
    end (issue 19 item 4: answered after a restart or logged ``Aborted("shutdown")``)."""
    url = db(tmp_path)
    go, streaming = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("x"), Signal(streaming), Wait(go)]])
    rt = Runtime(url, model=model, config=RuntimeConfig(max_live_agents=1))
    await rt.__aenter__()
    try:
        await rt.send("a", "busy")  # holds the only slot
        with anyio.fail_after(10):
            await streaming.wait()
        writes = HeldWrites(rt.store)
        writes.install()
        committed = writes.hold(user_write("q1"), after=True)  # in the log, caller not back
        sending = asyncio.ensure_future(rt.send("q", "q1"))
        with anyio.fail_after(10):
            await committed.reached.wait()
    except BaseException:
        await rt.__aexit__(None, None, None)
        raise
    with anyio.fail_after(30):
        await rt.__aexit__(None, None, None)  # the queue is closed while q1's write is out
    committed.release()
    await asyncio.wait([sending])
    writes.uninstall()
    await anyio.wait_all_tasks_blocked()
    error = sending.exception()
    turn = None if error is not None else sending.result()
    assert turn is None or turn.done(), "send returned a turn that nothing will ever end"


# -- mutation checks ---------------------------------------------------------------------


async def test_two_messages_sent_while_a_turn_runs_get_two_turn_numbers(
    tmp_path: Path,
) -> None:
    """Mutation (a): ``_handle_send`` numbering ``agent.turn + 1`` instead of
    ``agent.last_turn() + 1`` gives both postponed messages the open turn's number plus
    one (only the fuzzer, at random, noticed)."""
    go, streaming = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("x"), Signal(streaming), Wait(go)], "two", "three"])
    async with Runtime(db(tmp_path), model=model) as rt:
        first = await rt.send("c", "one")
        with anyio.fail_after(10):
            await streaming.wait()
        second = await rt.send("c", "two")
        third = await rt.send("c", "three")
        assert (first.number, second.number, third.number) == (1, 2, 3)
        go.set()
        with anyio.fail_after(10):
            await first.result()
            assert (await second.result()).text == "two"  # type: ignore[union-attr]
            assert (await third.result()).text == "three"  # type: ignore[union-attr]
        events = await rt.store.read_since("c", 0)
        users = [e.turn for e in events if isinstance(e.body, UserMessage)]
        assert users == [1, 2, 3]


class _Reporting:
    """The part of the agents' Host that ``Agent.set_state`` uses: it records reports."""

    def __init__(self) -> None:
        self.reported: list[tuple[AgentState, AgentState]] = []

    def on_state(self, agent: Agent, old: AgentState, new: AgentState) -> None:
        self.reported.append((old, new))


def test_an_undeclared_transition_leaves_the_state_as_it_was() -> None:
    """Mutation (f): ``Agent.set_state`` without its ``checked(...)`` writes the state
    before anything checks it (the host's report checks it too, but the record already
    holds the undeclared state when that raises)."""
    config = AgentConfig()
    agent = Agent("c", Profile(config, config.policy(), Toolbox([]), ()))
    host = _Reporting()
    assert agent.state is AgentState.REVIVING
    with pytest.raises(InvalidTransition):
        agent.set_state(cast(Host, host), AgentState.STREAMING)  # reviving -> streaming: no
    assert agent.state is AgentState.REVIVING and host.reported == []
    agent.set_state(cast(Host, host), AgentState.AWAITING_INPUT)  # declared: done, reported
    assert agent.state is AgentState.AWAITING_INPUT
    assert host.reported == [(AgentState.REVIVING, AgentState.AWAITING_INPUT)]


async def test_a_conversation_moved_away_fails_its_turns_with_where_it_went(
    tmp_path: Path,
) -> None:
    """Mutation (g): ``_stop``'s moved branch without ``current._fail(moved)``: the open
    turn's caller gets the turn's own ``TurnAborted("shutdown")`` instead of
    ``ShardMoved`` (with the new owner to retry at). Driven as ``ShardGate._retire``
    does, on one SQLite node (the cluster tests check followers, not turns)."""
    go, streaming = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("x"), Signal(streaming), Wait(go)]])
    async with Runtime(db(tmp_path), model=model) as rt:
        open_turn = await rt.send("c", "one")
        with anyio.fail_after(10):
            await streaming.wait()
        behind = await rt.send("c", "two")
        assert behind.postponed
        agent = rt._registry.get("c")
        assert agent is not None
        moved = ShardMoved("c", 3, "10.0.0.2:7000")
        rt._registry.remove(agent)
        task = rt._supervisor.retire(agent, moved)
        assert task is not None
        with anyio.fail_after(10):
            await asyncio.wait([task])
        for turn in (open_turn, behind):
            with pytest.raises(ShardMoved) as raised:
                await turn.result()
            assert raised.value.owner == "10.0.0.2:7000"


async def test_a_send_waiting_for_a_queued_conversation_when_the_runtime_stops_is_refused(
    tmp_path: Path,
) -> None:
    """Mutation (h): ``Admission.send`` without its "still queued?" check, made under the
    record's write lock. A second send waits for that lock while the first one's write
    is out; the runtime starts stopping and closes the queue (its store still open: the
    busy conversation's abort is held). The check sends it on to an actor
    (``RuntimeClosed``: nothing logged); without it, it logs the message into a record
    nobody runs any more and returns a turn that never ends."""
    url = db(tmp_path)
    go, streaming = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("x"), Signal(streaming), Wait(go)]])
    rt = Runtime(url, model=model, config=RuntimeConfig(max_live_agents=1))
    await rt.__aenter__()
    writes = HeldWrites(rt.store)
    try:
        await rt.send("a", "busy")  # holds the only slot
        with anyio.fail_after(10):
            await streaming.wait()
        writes.install()
        first_write = writes.hold(user_write("q1"))
        busy_abort = writes.hold(
            lambda w: w.conversation_id == "a" and any(isinstance(b, Aborted) for b in w.bodies)
        )
        first = asyncio.ensure_future(rt.send("q", "q1"))
        with anyio.fail_after(10):
            await first_write.reached.wait()
        second = asyncio.ensure_future(rt.send("q", "q2"))
        await anyio.wait_all_tasks_blocked()  # waits for the record's lock
        assert not second.done()
    except BaseException:
        writes.uninstall()
        await rt.__aexit__(None, None, None)
        raise
    stopping = asyncio.ensure_future(rt.__aexit__(None, None, None))
    with anyio.fail_after(10):
        await busy_abort.reached.wait()  # the queue is closed, the store still open
    first_write.release()
    with anyio.fail_after(10):
        await asyncio.wait([first, second])
    writes.uninstall()  # lets the abort through
    with anyio.fail_after(30):
        await stopping
    assert isinstance(second.exception(), RuntimeClosed), second
    async with Runtime(url, model=EchoModel()) as reopened:
        events = await reopened.store.read_since("q", 0)
        assert "q2" not in [e.body.text for e in events if isinstance(e.body, UserMessage)]


class _Reads:
    """Forwards ``store.resume`` to the store's own method and notes when it is called for
    one conversation and when that read returns (the hook HeldWrites uses for writes)."""

    def __init__(self, store: Any, conversation_id: str) -> None:
        self.called = anyio.Event()
        self.returned = anyio.Event()
        original = store.resume

        async def resume(cid: str) -> Any:
            if cid == conversation_id:
                self.called.set()
            try:
                return await original(cid)
            finally:
                if cid == conversation_id:
                    self.returned.set()

        store.resume = resume
        self._store = store

    def uninstall(self) -> None:
        del self._store.resume


async def test_a_queued_conversations_revival_waits_for_its_write_in_flight(
    tmp_path: Path,
) -> None:
    """Mutation (i): ``revive`` not taking the record's existing write lock. A queued
    conversation's message is committed but the admission queue has not yet recorded its
    postponed turn when a slot frees; a revival that reads the log then takes the message
    for a turn that died mid-way (logs ``Aborted(interrupted)``) and misses the turn the
    queue records after it. Under the lock it reads once the queue is done."""
    go, streaming = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("x"), Signal(streaming), Wait(go)], "answer q1"])
    async with Runtime(db(tmp_path), model=model, config=RuntimeConfig(max_live_agents=1)) as rt:
        busy = await rt.send("a", "busy")  # holds the only slot
        with anyio.fail_after(10):
            await streaming.wait()
        reads = _Reads(rt.store, "q")
        with HeldWrites(rt.store) as writes, rt.admin.watch() as watcher:
            committed = writes.hold(user_write("q1"), after=True)  # logged, queue not back
            sending = asyncio.ensure_future(rt.send("q", "q1"))
            with anyio.fail_after(10):
                await committed.reached.wait()
            go.set()  # "a" ends and idles: its slot goes to "q", whose actor revives
            with anyio.fail_after(10):
                await busy.result()
            await until(watcher, "q", "reviving")
            await anyio.wait_all_tasks_blocked()
            if reads.called.is_set():  # it reads while the queue's write is out: let it end
                await until(watcher, "q", "awaiting_input")
            committed.release()
            with anyio.fail_after(10):
                turn = await sending
        reads.uninstall()
        assert turn.postponed
        events = await rt.store.read_since("q", 0)
        assert not [end for end in ends(events, turn.number) if end.startswith("aborted")]
        with anyio.fail_after(10):
            result = await turn.result()
        assert isinstance(result, AssistantMessage) and result.text == "answer q1"
        events = await rt.store.read_since("q", 0)
        assert ends(events, turn.number) == ["answer"]


async def test_a_request_to_hibernate_read_after_input_arrived_changes_nothing(
    tmp_path: Path,
) -> None:
    """Mutation (j): the actor hibernating on a ``HibernateRequest`` when it is no longer
    idle. The request is posted while the agent is idle, a message arrives before the
    actor reads it: the answer is False and the working set is kept (no second revival),
    instead of True and a drop of the caches the next message needs at once."""
    async with Runtime(db(tmp_path), model=EchoModel()) as rt:
        await (await rt.send("c", "one")).result()
        revivals = (await rt.admin.stats()).revivals
        with rt.admin.watch() as watcher:
            hibernated, turn = await asyncio.gather(  # in this order, before the actor runs
                rt.admin.hibernate("c"), rt.send("c", "two")
            )
            with anyio.fail_after(10):
                assert (await turn.result()).text == "echo: two"  # type: ignore[union-attr]
            watcher.close()
            seen = [t.new async for t in watcher if t.conversation_id == "c"]
        assert hibernated is False
        assert "hibernated" not in seen
        assert (await rt.admin.stats()).revivals == revivals


async def test_hibernating_is_announced_to_watchers(tmp_path: Path) -> None:
    """Finding 5. ``AgentHost.on_hibernated`` reports ``hibernated`` through
    ``Agent.report``, but the actor calls it after ``_drop_caches``: the record already
    shows ``hibernated``, so the report is skipped as "no change". A watcher never sees
    an agent go to ``hibernated`` (main announced it from the lifecycle); it next sees
    ``hibernated -> reviving`` out of nowhere."""
    async with Runtime(db(tmp_path), model=EchoModel()) as rt:
        await (await rt.send("c", "hello")).result()
        with rt.admin.watch() as watcher:
            assert await rt.admin.hibernate("c")
            await (await rt.send("c", "again")).result()
            watcher.close()
            seen = [(t.old, t.new) async for t in watcher if t.conversation_id == "c"]
        assert seen[0] == ("awaiting_input", "hibernated"), seen


APPROVE = ExternalTool("approve", "ask a person", {"type": "object"})


@pytest.mark.parametrize("hibernated", [False, True], ids=["live", "hibernated"])
async def test_a_turn_postponed_behind_a_suspension_survives_shutdown_and_ends_once(
    tmp_path: Path, hibernated: bool
) -> None:
    """Findings 6 and 7, settled on the README's promise: behind a suspension a postponed
    turn waits for the answer, which survives a restart in the log; so it is not ended at
    shutdown (its caller's handle fails: that process stopped), and after a restart and the
    approval it runs, and the log ends it exactly once, answered."""
    url = db(tmp_path)
    model = ScriptedModel([[Call("approve", {}, id="a1")]])
    agent = AgentConfig(tools=[APPROVE])
    async with Runtime(url, model=model, agent=agent) as rt:
        with anyio.fail_after(10):
            assert isinstance(await (await rt.send("c", "pay")).result(), Suspended)
        later = await rt.send("c", "later")
        assert later.postponed
        if hibernated:
            assert await rt.admin.hibernate("c")  # suspended: it may hibernate
    with pytest.raises(TurnAborted) as told:
        await later.result()
    assert told.value.reason == "shutdown"
    async with Runtime(url, model=ScriptedModel(["approved", "later done", "more"]),
                       agent=agent) as rt:
        events = await rt.store.read_since("c", 0)
        assert ends(events, later.number) == []  # still waiting behind the suspension
        with anyio.fail_after(10):
            continuation = await rt.resolve("c", "a1", "ok")
            assert continuation is not None
            await continuation.result()
            after = await (await rt.send("c", "next")).result()
        assert isinstance(after, AssistantMessage) and after.text == "more"
        events = await rt.store.read_since("c", 0)
    assert ends(events, later.number) == ["answer"], "the postponed turn ran once"


async def test_a_caller_that_gives_up_during_the_actors_write_does_not_crash_it(
    tmp_path: Path,
) -> None:
    """Finding 8. The actor answers some requests after awaiting their write with a bare
    ``done.set_result`` (``_handle_card``, ``_handle_cancel``'s suspended path,
    ``_handle_resolve`` while other calls are pending, ``handle_spawn``'s conflict): a
    caller cancelled meanwhile (a client timeout, a disconnected HTTP request) has
    cancelled that future, ``set_result`` raises ``InvalidStateError`` and the actor
    crashes, which counts towards parking. Shown with a task card change."""
    async with Runtime(db(tmp_path), model=EchoModel()) as rt:
        await (await rt.send("c", "hello")).result()
        with HeldWrites(rt.store) as writes:
            card_write = writes.hold(
                lambda w: w.conversation_id == "c"
                and any(type(b).__name__ == "TaskCard" for b in w.bodies)
            )
            update = asyncio.ensure_future(rt.task("c").update(goal="g"))
            with anyio.fail_after(10):
                await card_write.reached.wait()
            update.cancel()  # the caller gives up while the actor writes
            await asyncio.wait([update])
            card_write.release()
            with anyio.fail_after(10):
                await card_write.done.wait()
            await anyio.wait_all_tasks_blocked()
        stats = await rt.admin.stats()
        assert (stats.crashes, stats.restarts) == (0, 0), "the actor crashed"
        card = await rt.task("c").get()
        assert card is not None and card.goal == "g"  # written: the change stands
