"""Issue 19, item 2, end to end: a Runtime whose SQLite database cannot write (a real
tmpfs filled up, or the files made immutable) answers every caller promptly, with a
result or ``StoreUnavailable``, logs a bounded number of warnings, and after the fault
answers every conversation again with every acknowledged message logged exactly once.

Only the public API drives the runtime (``send``, ``Turn.result``, ``resolve``,
``admin``); the faults are real (see conftest's ``tiny_filesystem`` and ``immutable``).
A model of the test's own holds chosen turns mid-stream on events, so a turn is known
to be in flight when the fault starts. ``anyio.fail_after`` is a hang guard only: the
promise is ``store_retry_deadline`` plus a second, the guard is far past it, and no
assertion here reads a clock.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from torpor import (
    Aborted,
    AgentConfig,
    AssistantMessage,
    ExternalTool,
    Runtime,
    RuntimeConfig,
    StoreUnavailable,
    Suspended,
    Turn,
    UserMessage,
)
from torpor.events import ToolCall
from torpor.llm.protocol import ContextMessage, StreamEvent, TextDelta, ToolCallDelta, ToolSpec

DEADLINE = 1.0  # store_retry_deadline in these tests
GUARD = DEADLINE + 14  # a hang guard, not a timing assertion: the promise is DEADLINE + 1
APPROVE = ExternalTool("approve", "Ask a human", {"type": "object", "properties": {}})
AGENT = AgentConfig(tools=[APPROVE])


class Gated:
    """Answers ``re: <last user text>``; holds the turns of chosen texts mid-stream.

    A held turn streams ``partial``, sets ``reached[text]`` and waits for ``go[text]``
    (events, never sleeps). A text containing ``approve`` asks for the ``approve`` tool,
    whose answer the runtime awaits from ``resolve`` (a suspended turn).
    """

    name = "gated"

    def __init__(self) -> None:
        self.reached: dict[str, anyio.Event] = {}
        self.go: dict[str, anyio.Event] = {}

    def hold(self, text: str) -> str:
        self.reached[text], self.go[text] = anyio.Event(), anyio.Event()
        return text

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        last = context[-1]
        if not isinstance(last, UserMessage):  # after the tool's answer
            yield TextDelta("approved")
            return
        if "approve" in last.text:
            yield ToolCallDelta(ToolCall(f"call-{last.text}", "approve", {}))
            return
        if last.text in self.go:
            yield TextDelta("partial ")
            self.reached[last.text].set()
            await self.go[last.text].wait()
        yield TextDelta(f"re: {last.text}")


class Warnings(logging.Handler):
    """torpor's records at warning and above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def warnings() -> Iterator[Warnings]:
    handler = Warnings()
    logger = logging.getLogger("torpor")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


# -- the faults ------------------------------------------------------------------------


class Fault:
    def __init__(self, directory: Path) -> None:
        self.path = directory / "log.db"
        self.url = f"sqlite:///{self.path}"

    async def start(self, rt: Runtime) -> None:
        raise NotImplementedError

    async def clear(self) -> None:
        raise NotImplementedError


class FullDisk(Fault):
    """The tmpfs fills up: a filler file takes what is left, then filler rows take the
    room the database's own pages still had (written through the store, under a
    conversation of their own). Deleting the filler file gives the space back."""

    async def start(self, rt: Runtime) -> None:
        filler = self.path.parent / "filler"
        with contextlib.suppress(OSError), filler.open("ab") as out:
            while True:
                out.write(b"\0" * 4096)
                out.flush()
        for size in (20_000, 2_000, 200, 0):
            for _ in range(200):
                try:
                    await rt.store.append("~filler", [UserMessage("f" * size)])
                except StoreUnavailable:
                    break

    async def clear(self) -> None:
        (self.path.parent / "filler").unlink()


class ReadOnly(Fault):
    """The database and its WAL get the immutable attribute (refused even to root)."""

    def __init__(self, directory: Path, set_immutable: Callable[[list[Path], bool], None]):
        super().__init__(directory)
        self._set = set_immutable
        self._files = [self.path, Path(f"{self.path}-wal")]  # not -shm: it is mapped

    async def start(self, rt: Runtime) -> None:
        self._set(self._files, True)

    async def clear(self) -> None:
        self._set(self._files, False)


@pytest.fixture(params=["full-disk", "read-only"])
def fault(request: pytest.FixtureRequest, tmp_path: Path) -> Fault:
    if request.param == "full-disk":
        return FullDisk(request.getfixturevalue("tiny_filesystem"))
    return ReadOnly(tmp_path, request.getfixturevalue("immutable"))


# -- what callers were told --------------------------------------------------------------


class Ledger:
    """Every send and its outcome: acknowledged (a Turn) or refused (StoreUnavailable)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.acked: dict[str, list[str]] = {}
        self.refused: list[str] = []
        self.unexpected: list[tuple[str, BaseException]] = []

    async def send(self, conversation: str, text: str) -> Turn | None:
        """The send, under the hang guard; None when it was refused."""
        with anyio.fail_after(GUARD):
            try:
                turn = await self.rt.send(conversation, text)
            except StoreUnavailable:
                self.refused.append(text)
                return None
        self.acked.setdefault(conversation, []).append(text)
        return turn

    async def logged(self) -> dict[str, list[str]]:
        users: dict[str, list[str]] = {}
        for conversation in self.acked:
            for event in await self.rt.store.read_since(conversation, 0):
                if isinstance(event.body, UserMessage):
                    users.setdefault(conversation, []).append(event.body.text)
        return users


async def outcomes(waits: dict[str, Awaitable[Any]]) -> dict[str, Any]:
    """Each wait's result or exception, all awaited at once under one hang guard."""
    got: dict[str, Any] = {}

    async def one(name: str, wait: Awaitable[Any]) -> None:
        try:
            got[name] = await wait
        except Exception as exc:
            got[name] = exc

    with anyio.move_on_after(GUARD):  # the hang guard: names what still waits
        async with anyio.create_task_group() as tg:
            for name, wait in waits.items():
                tg.start_soon(one, name, wait)
    hung = sorted(set(waits) - set(got))
    assert not hung, f"still waiting after {GUARD} s: {hung}"
    return got


async def ends_of_turns(rt: Runtime, conversation: str) -> dict[int, list[str]]:
    """For each turn that holds a user message: how the log ended it (answers, aborts)."""
    ends: dict[int, list[str]] = {}
    for event in await rt.store.read_since(conversation, 0):
        body = event.body
        if isinstance(body, UserMessage):
            ends.setdefault(event.turn, [])
        elif isinstance(body, AssistantMessage) and not body.tool_calls:
            ends.setdefault(event.turn, []).append("answer")
        elif isinstance(body, Aborted):
            ends.setdefault(event.turn, []).append(f"aborted:{body.reason}")
        elif isinstance(body, Suspended):
            ends.setdefault(event.turn, []).append("suspended")
    return ends


# -- the scenario ------------------------------------------------------------------------

STREAMING = ("stream-0", "stream-1", "stream-2")
ROUNDS = 4  # rounds of sends to every conversation while the fault lasts


async def test_a_runtime_on_a_store_that_cannot_write_answers_every_caller(
    fault: Fault, warnings: Warnings
) -> None:
    model = Gated()
    config = RuntimeConfig(store_retry_deadline=DEADLINE, hibernate_after=3600, evict_after=7200)
    async with Runtime(fault.url, model=model, agent=AGENT, config=config) as rt:
        ledger = Ledger(rt)
        # Before the fault: turns held mid-stream, one with a turn postponed behind it,
        # one suspended on a tool call, idle, hibernated and evicted conversations.
        streaming = {c: await ledger.send(c, model.hold(f"{c} slow")) for c in STREAMING}
        held = await ledger.send("postponer", model.hold("postponer slow"))
        behind = await ledger.send("postponer", "postponer later")
        assert behind is not None and behind.postponed
        asking = await ledger.send("suspended", "suspended approve")
        assert asking is not None and isinstance(await asking.result(), Suspended)
        for c in ("idle", "hibernated", "evicted"):
            turn = await ledger.send(c, f"{c} hello")
            assert turn is not None and (await turn.result()).text == f"re: {c} hello"
        assert await rt.admin.hibernate("hibernated")
        assert await rt.admin.evict("evicted")
        for reached in model.reached.values():
            await reached.wait()
        assert not ledger.refused

        await fault.start(rt)
        warnings.records.clear()
        for go in model.go.values():
            go.set()  # the held answers are complete now, and cannot be committed
        pending: dict[str, Awaitable[Any]] = {
            f"{c} slow": turn.result() for c, turn in streaming.items() if turn is not None
        }
        assert held is not None
        pending.update({"postponer slow": held.result(), "postponer later": behind.result()})
        first = await outcomes(pending)
        for name, outcome in first.items():
            assert isinstance(outcome, StoreUnavailable | AssistantMessage), (name, outcome)
        # The held turns' answers could not be committed: their callers were told so.
        assert all(isinstance(first[f"{c} slow"], StoreUnavailable) for c in STREAMING)

        conversations = [*STREAMING, "postponer", "suspended", "idle", "hibernated", "evicted",
                         "fresh"]
        for n in range(ROUNDS):
            sent = {c: await ledger.send(c, f"{c} during {n}") for c in conversations}
            with anyio.fail_after(GUARD), pytest.raises(StoreUnavailable):
                await rt.resolve("suspended", "call-suspended approve", "yes")
            done = await outcomes(
                {c: turn.result() for c, turn in sent.items() if turn is not None}
            )
            for name, outcome in done.items():
                assert isinstance(outcome, StoreUnavailable | AssistantMessage), (name, outcome)
        assert ledger.refused  # the fault was real: sends were refused
        during = [r.getMessage() for r in warnings.records]
        assert len(during) < 100, during
        # The runtime's own: one per conversation whose turn broke and episode, not one per
        # refused retry (each send to such a conversation retries at once).
        broken = [*STREAMING, "postponer"]
        retrying = [r for r in warnings.records if r.name == "torpor.runtime"]
        assert {getattr(r, "conversation_id", None) for r in retrying} <= set(broken), during
        assert len(retrying) <= 2 * len(broken), during

        await fault.clear()
        # Every conversation answers again (a postponed turn first, the suspended one once
        # its approval comes).
        after = {c: await ledger.send(c, f"{c} after") for c in conversations}
        with anyio.fail_after(GUARD):
            continued = await rt.resolve("suspended", "call-suspended approve", "yes")
            assert continued is not None and (await continued.result()).text == "approved"
        replies = await outcomes({c: t.result() for c, t in after.items() if t is not None})
        assert {c: getattr(r, "text", r) for c, r in replies.items()} == {
            c: f"re: {c} after" for c in conversations
        }

        # The log holds every acknowledged message once, in order, and no refused one.
        logged = await ledger.logged()
        assert logged == ledger.acked
        assert not set(ledger.refused) & {t for texts in logged.values() for t in texts}
        # Every acknowledged turn has exactly one end: the postponed one was answered.
        for c in ledger.acked:
            ends = await ends_of_turns(rt, c)
            for turn_number, how in ends.items():
                if c == "suspended" and how and how[0] == "suspended":
                    how = how[1:]  # its approval came after the fault
                assert len(how) == 1, (c, turn_number, how)
        with anyio.fail_after(GUARD):  # the postponed turn's caller may ask again
            assert (await behind.result()).text == "re: postponer later"
        postponer = await ends_of_turns(rt, "postponer")
        assert behind.number in postponer and postponer[behind.number] == ["answer"]


# -- one caller at a time ------------------------------------------------------------------


@pytest.fixture
def read_only(tmp_path: Path, immutable: Callable[[list[Path], bool], None]) -> Fault:
    """The fault that does not come and go (a full disk may, as checkpoints free room)."""
    return ReadOnly(tmp_path, immutable)


async def users(rt: Runtime, conversation: str) -> list[str]:
    return [e.body.text for e in await rt.store.read_since(conversation, 0)
            if isinstance(e.body, UserMessage)]


async def test_a_send_to_an_agent_in_a_store_down_backoff_is_refused_at_once(
    read_only: Fault,
) -> None:
    model = Gated()
    # Backoffs far past the hang guard: a send that waited one out would trip the guard.
    config = RuntimeConfig(store_retry_deadline=DEADLINE, backoff_initial=10 * GUARD,
                           backoff_max=10 * GUARD)
    async with Runtime(read_only.url, model=model, config=config) as rt:
        turn = await rt.send("c", model.hold("c slow"))
        await model.reached["c slow"].wait()
        await read_only.start(rt)
        model.go["c slow"].set()
        with anyio.fail_after(GUARD), pytest.raises(StoreUnavailable):
            await turn.result()  # its answer could not be logged: the agent backs off
        assert (await rt.admin.stats()).store_failures == 1
        for i in range(3):  # each cuts the backoff short, is tried, and refused
            with anyio.fail_after(GUARD), pytest.raises(StoreUnavailable):
                await rt.send("c", f"c refused {i}")
        assert (await rt.admin.stats()).store_failures == 4
        await read_only.clear()
        with anyio.fail_after(GUARD):  # the next send cuts it short too, and is answered
            assert (await (await rt.send("c", "c after")).result()).text == "re: c after"
        assert await users(rt, "c") == ["c slow", "c after"]
        assert await ends_of_turns(rt, "c") == {1: ["aborted:interrupted"], 2: ["answer"]}


async def test_a_postponed_turn_behind_an_answer_that_could_not_be_logged(
    read_only: Fault,
) -> None:
    model = Gated()
    config = RuntimeConfig(store_retry_deadline=DEADLINE)
    async with Runtime(read_only.url, model=model, config=config) as rt:
        held = await rt.send("c", model.hold("c slow"))
        behind = await rt.send("c", "c later", key="later")
        assert behind.postponed
        await model.reached["c slow"].wait()
        await read_only.start(rt)
        model.go["c slow"].set()
        with anyio.fail_after(GUARD):
            with pytest.raises(StoreUnavailable):
                await held.result()
            # It cannot run before the log ends the turn that broke: its caller is told so
            # now, every time it asks, instead of waiting as long as the store refuses.
            for _ in range(2):
                with pytest.raises(StoreUnavailable, match="runs once the store writes"):
                    await behind.result()
        await read_only.clear()
        with anyio.fail_after(GUARD):
            # Its caller asks again (the same key: the same turn), and it is answered.
            again = await rt.send("c", "c later", key="later")
            assert again.number == behind.number
            assert (await again.result()).text == "re: c later"
            assert (await behind.result()).text == "re: c later"
        assert await users(rt, "c") == ["c slow", "c later"]
        assert await ends_of_turns(rt, "c") == {1: ["aborted:interrupted"], 2: ["answer"]}
