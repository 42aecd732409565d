"""Issue 8 through the real runtime: faults a caller cannot prevent, and input it should not send.

Text the log cannot hold (item 5), a store that cannot write (item 6), a model
answer over the event size limit (item 7), a tool that ignores cancellation and
a model that stalls (item 8), a hole in the log (item 9), and every error typed
and exported (item 10). Each test fails when the fix it names is taken out.

Real SQLite files; PostgreSQL too (the ``backend`` fixture) where the promise
is "the same on every backend". No sleeps as synchronisation.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import shutil
import sqlite3
import subprocess
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from store_backends import Backend

import torpor
import torpor.errors
from torpor import (
    Aborted,
    AgentConfig,
    AssistantMessage,
    CorruptEvent,
    CorruptStore,
    ExternalTool,
    IdempotencyConflict,
    InvalidInput,
    Runtime,
    RuntimeConfig,
    ScriptedModel,
    StoreUnavailable,
    Suspended,
    TextDelta,
    ToolResult,
    TorporError,
    TurnAborted,
    UnknownConversation,
    UnsupportedStoreURL,
    UserMessage,
)
from torpor.events import Event
from torpor.llm import Call, Signal, Text, Wait
from torpor.llm.protocol import ContextMessage, StreamEvent, ToolSpec

APPROVE = ExternalTool(
    "approve",
    "Ask a human to approve a payment.",
    {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 1}},
     "required": ["amount"], "additionalProperties": False},
)


def url_of(backend: Backend) -> str:
    return f"sqlite:///{backend.location}" if backend.name == "sqlite" else backend.location


def db(tmp_path: Path, name: str = "log.db") -> str:
    return f"sqlite:///{tmp_path / name}"


async def log_of(rt: Runtime, conv: str) -> list[Event]:
    return list(reversed(await rt.history(conv, limit=10_000)))


# -- item 5: text the log cannot hold ---------------------------------------------------------

UNSTORABLE = ["lone \udc80 surrogate", "high \ud800", "nul \x00 byte", "\x00"]


async def test_unstorable_text_is_refused_at_the_boundary_on_every_backend(
    backend: Backend,
) -> None:
    model = ScriptedModel([[Call("approve", {"amount": 5}, id="call-1")], [Text("ok")]])
    async with Runtime(url_of(backend), model=model, agent=AgentConfig(tools=[APPROVE])) as rt:
        with anyio.fail_after(20):  # every request completes, with a result or an error
            for bad in UNSTORABLE:
                for call in (
                    rt.send(bad, "hello"),
                    rt.send("c", bad),
                    rt.send("c", "hello", key=bad),
                ):
                    with pytest.raises(InvalidInput):
                        await call
            assert await rt.store.conversations() == []  # nothing was written
            assert len(rt._registry) == 0  # nor remembered

            turn = await rt.send("c", "pay")
            assert isinstance(await turn.result(), Suspended)
            head = await rt.store.head("c")
            for bad in UNSTORABLE:
                with pytest.raises(InvalidInput):
                    await rt.resolve("c", "call-1", bad)
                with pytest.raises(InvalidInput):
                    await rt.resolve("c", bad, "fine")
                with pytest.raises(InvalidInput):
                    await rt.resolve(bad, "call-1", "fine")
                with pytest.raises(InvalidInput):
                    await rt.cancel(bad)
                with pytest.raises(InvalidInput):
                    await rt.history(bad)
                await rt.recall("c", bad)  # a query is not stored: it searches, no raw error
            assert await rt.store.head("c") == head
            assert (await rt.admin.inspect("c")).state == "suspended"
            continuation = await rt.resolve("c", "call-1", "approved \u2713")
            assert continuation is not None
            assert (await continuation.result()).text == "ok"
            stats = await rt.admin.stats()
            assert stats.crashes == 0 and stats.parks == 0
            # The store's own search takes the same query without a raw driver error.
            assert await rt.store.search("c", "a\x00b", 5) == []


async def test_a_model_and_a_tool_producing_lone_surrogates_are_repaired_visibly(
    backend: Backend,
) -> None:
    @torpor.tool
    async def mirror(text: str) -> str:
        """Returns the text with a broken character appended."""
        return text + "\udc81"

    model = ScriptedModel([
        [Text("bad \udc80 "), Text("stream"), Call("mirror", {"text": "\ud800x"}, id="m-1")],
        [Text("done \udfff")],
    ])
    async with Runtime(url_of(backend), model=model, agent=AgentConfig(tools=[mirror])) as rt:
        follower = rt.subscribe("c")
        turn = await rt.send("c", "go")
        with anyio.fail_after(20):
            streamed = [i.text async for i in turn if isinstance(i, TextDelta)]
            final = await turn.result()
        assert isinstance(final, AssistantMessage) and final.text == "done \ufffd"
        assert "".join(streamed) == "bad \ufffd streamdone \ufffd"  # both calls, repaired
        bodies = [e.body for e in await log_of(rt, "c")]
        assert [type(b) for b in bodies] == [UserMessage, AssistantMessage, ToolResult,
                                             AssistantMessage]
        first, result, last = bodies[1:]
        assert isinstance(first, AssistantMessage) and first.text == "bad \ufffd stream"
        assert first.tool_calls[0].arguments == {"text": "\ufffdx"}  # what the tool got
        assert isinstance(result, ToolResult) and not result.is_error
        assert result.content == "\ufffdx\ufffd"
        assert last == AssistantMessage("done \ufffd")
        async with follower:
            text = ""
            with anyio.fail_after(10):
                async for item in follower:
                    if isinstance(item, TextDelta):
                        text += item.text
                    elif isinstance(item.body, AssistantMessage) and not item.body.tool_calls:
                        break
        assert text == "bad \ufffd streamdone \ufffd"
        assert (await rt.admin.stats()).crashes == 0


class Exploding(logging.Handler):
    """A handler whose emit raises, as a broken log shipper would."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.calls = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.calls += 1
        raise RuntimeError("the log shipper is down")


class Unformattable(logging.Handler):
    """A handler whose records fail to format (a format naming a field nobody sets)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(no_such_field)s %(message)s"))
        self.calls = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.calls += 1
        self.format(record)  # raises KeyError; emit does not catch it


@pytest.fixture(params=[Exploding, Unformattable])
def broken_logging(request: pytest.FixtureRequest) -> Iterator[logging.Handler]:
    logger = logging.getLogger("torpor")
    handler: logging.Handler = request.param()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class FailsOnce:
    """A summarizer that raises the first time: the agent crashes once, mid-turn."""

    failed = False

    async def summarize(self, previous: str, events: Any) -> str:
        if not self.failed:
            self.failed = True
            raise RuntimeError("summarizer hiccup")
        return "summary"


async def test_a_logging_handler_that_raises_cannot_kill_the_supervisor(
    tmp_path: Path, broken_logging: Any
) -> None:
    config = AgentConfig(summarizer=FailsOnce(), working_budget=40, tail_turns=1)
    fast = RuntimeConfig(backoff_initial=0.001, backoff_max=0.01)
    async with Runtime(db(tmp_path), agent=config, config=fast) as rt:
        with anyio.fail_after(20):
            assert (await (await rt.send("c", "a first message with words " * 3)).result()).text
            crashed = await rt.send("c", "a message long enough to force a fold " * 4)
            with pytest.raises(TurnAborted) as info:
                await crashed.result()
            assert info.value.reason == "crashed"
            # The crash was reported through the broken handler; the agent was restarted.
            again = await rt.send("c", "still there?")
            assert (await again.result()).text == "echo: still there?"
        stats = await rt.admin.stats()
        assert stats.crashes == 1 and stats.restarts == 1 and stats.parks == 0
    assert broken_logging.calls > 0


# -- item 7: a model answer over the event size limit ----------------------------------------

MIB = 1024 * 1024
CHUNK = "0123456789abcdef" * 4096  # 64 KiB


async def test_an_answer_over_the_event_limit_is_kept_whole_in_an_artifact(
    backend: Backend,
) -> None:
    answer = CHUNK * 20 + "the end"  # 1.25 MiB
    model = ScriptedModel([[Text(CHUNK * 10), Text(CHUNK * 10 + "the end")], [Text("small")]])
    async with Runtime(url_of(backend), model=model) as rt:
        turn = await rt.send("c", "write a lot")
        with anyio.fail_after(30):
            final = await turn.result()
        assert isinstance(final, AssistantMessage) and final.text == answer
        logged = (await log_of(rt, "c"))[-1]
        assert isinstance(logged.body, AssistantMessage)
        assert logged.body.artifact is not None
        assert logged.body.full_size == len(answer.encode())
        assert len(logged.body.text.encode()) < MIB  # the row holds a preview
        (expanded,) = await rt.expand("c", logged.position, logged.position)
        assert isinstance(expanded.body, AssistantMessage) and expanded.body.text == answer
        assert (await (await rt.send("c", "and now?")).result()).text == "small"
        stats = await rt.admin.stats()
        assert stats.crashes == 0


async def test_a_cancelled_stream_over_the_limit_keeps_its_partial_text(
    backend: Backend,
) -> None:
    reached, never = anyio.Event(), anyio.Event()
    partial = CHUNK * 20
    model = ScriptedModel([[Text(CHUNK * 10), Text(CHUNK * 10), Signal(reached), Wait(never)],
                           [Text("next")]])
    async with Runtime(url_of(backend), model=model) as rt:
        turn = await rt.send("c", "write a lot")
        with anyio.fail_after(30):
            await reached.wait()
            assert await rt.cancel("c") is True
            with pytest.raises(TurnAborted) as info:
                await turn.result()
        assert info.value.reason == "cancelled"
        assert info.value.partial_text == partial
        logged = (await log_of(rt, "c"))[-1]
        assert isinstance(logged.body, Aborted) and logged.body.reason == "cancelled"
        assert logged.body.artifact is not None and logged.body.full_size == len(partial)
        (expanded,) = await rt.expand("c", logged.position, logged.position)
        assert isinstance(expanded.body, Aborted) and expanded.body.partial_text == partial
        assert (await (await rt.send("c", "again")).result()).text == "next"
        assert (await rt.admin.stats()).crashes == 0


# -- item 9: a hole in the log ---------------------------------------------------------------


async def test_a_hole_in_the_log_is_reported_by_history_and_revival(backend: Backend) -> None:
    fast = RuntimeConfig(backoff_initial=0.001, backoff_max=0.01)
    async with Runtime(url_of(backend), config=fast) as rt:
        for text in ("one", "two", "three"):
            await (await rt.send("c", text)).result()
            await (await rt.send("other", text)).result()
        assert await rt.admin.evict("c")
        await backend.delete_event("c", 2)
        with pytest.raises(CorruptEvent) as info:
            await rt.history("c")
        assert info.value.position == 2 and info.value.conversation_id == "c"
        with pytest.raises(CorruptEvent) as info:
            await rt.expand("c", 0, 5)
        assert info.value.position == 2
        with anyio.fail_after(20):
            with pytest.raises(CorruptEvent) as info:
                await rt.send("c", "wake up")  # the revival reads the log and finds the hole
            assert info.value.position == 2
            with pytest.raises(CorruptEvent):  # and again: it is not parked, it is unreadable
                await rt.send("c", "wake up")
            with pytest.raises(CorruptEvent):
                await rt.admin.inspect("c")
            # The runtime and every other conversation go on.
            assert (await (await rt.send("other", "four")).result()).text == "echo: four"
        assert [e.position for e in await log_of(rt, "other")] == list(range(8))
        assert await rt.store.head("c") == 5  # nothing was appended to the damaged log
        stats = await rt.admin.stats()
        assert stats.parks == 0


# -- item 10: every error typed and exported ----------------------------------------------


def error_classes() -> list[type[BaseException]]:
    return [
        value for value in vars(torpor.errors).values()
        if inspect.isclass(value) and issubclass(value, BaseException)
        and value.__module__ == torpor.errors.__name__
    ]


def test_every_error_class_is_a_torpor_error_and_exported() -> None:
    classes = error_classes()
    assert len(classes) >= 20
    for cls in classes:
        assert issubclass(cls, TorporError), cls
        assert cls.__name__ in torpor.__all__, cls
        assert getattr(torpor, cls.__name__) is cls
        assert cls.__name__ in torpor.errors.__all__
    assert issubclass(InvalidInput, ValueError)


def test_a_bad_store_url_fails_when_the_runtime_is_constructed() -> None:
    for url in ("mysql://localhost/db", "chat.db", "sqlite:relative.db", "sqlite:///", 42):
        with pytest.raises(UnsupportedStoreURL):
            Runtime(url)  # type: ignore[arg-type]


def damage_file(path: Path, damage: str) -> None:
    data = path.read_bytes()
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 3 + 100])
    else:
        path.write_bytes(b"\0" * 100 + data[100:])


@pytest.mark.parametrize("damage", ["garbage", "truncated", "zeroed header"])
async def test_a_damaged_database_file_raises_corrupt_store_on_entry(
    tmp_path: Path, damage: str
) -> None:
    path = tmp_path / "log.db"
    if damage == "garbage":
        path.write_bytes(os.urandom(64 * 1024))
    else:
        async with Runtime(db(tmp_path)) as rt:
            for i in range(20):
                await (await rt.send(f"c{i}", "words " * 200)).result()
        damage_file(path, damage)
    with pytest.raises(CorruptStore):
        async with Runtime(db(tmp_path)) as rt:
            for i in range(20):  # damage may only show on the read that reaches it
                await rt.history(f"c{i}")


async def test_bad_arguments_raise_invalid_input_and_leave_nothing_behind(
    tmp_path: Path,
) -> None:
    async with Runtime(db(tmp_path), model=ScriptedModel.replies("a", loop=True)) as rt:
        await (await rt.send("c", "hello")).result()
        bad_ids: list[Any] = ["", "x" * 257, None, 5, b"c", "a\x00b", "\udc80"]
        for bad in bad_ids:
            for call in (
                lambda b: rt.send(b, "x"),
                lambda b: rt.resolve(b, "call", "x"),
                lambda b: rt.cancel(b),
                lambda b: rt.history(b),
                lambda b: rt.recall(b, "hello"),
                lambda b: rt.expand(b, 0, 1),
                lambda b: rt.admin.inspect(b),
                lambda b: rt.admin.unpark(b),
                *([] if bad is None else [lambda b: rt.send("c", "x", key=b)]),
            ):
                with pytest.raises(InvalidInput) as info:
                    await call(bad)
                assert isinstance(info.value, ValueError)
            with pytest.raises(InvalidInput):
                rt.subscribe(bad)
        for position in (2**70, -2, 1.5, "3", True):
            with pytest.raises(InvalidInput):
                await rt.history("c", before=position)
            with pytest.raises(InvalidInput):
                await rt.expand("c", position, 3)
            with pytest.raises(InvalidInput):
                await rt.expand("c", 0, position)
            with pytest.raises(InvalidInput):
                rt.subscribe("c", after=position)
        with pytest.raises(InvalidInput):
            await rt.expand("c", 3, 1)
        for limit in (0, -1, 10**9, 2**70, 2.0):
            with pytest.raises(InvalidInput):
                await rt.history("c", limit=limit)
            with pytest.raises(InvalidInput):
                await rt.recall("c", "hello", k=limit)
        with pytest.raises(InvalidInput):
            await rt.recall(None, "hello")  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            await rt.recall("c", None)  # type: ignore[arg-type]
        # A query is never stored: NUL and lone surrogates search as word breaks (SQLite's
        # FTS raised a raw error here), the same on every backend.
        assert [h.position for h in await rt.recall("c", "hello\x00nothing")] == [0]
        assert [h.position for h in await rt.recall("c", "hello")] == [0]
        assert [c.conversation_id for c in await rt.store.conversations()] == ["c"]
        assert list(rt._registry.agents) == ["c"]
        assert rt._host.followers_by_id == {}


async def test_idempotency_key_reused_for_another_text_is_refused(tmp_path: Path) -> None:
    go = anyio.Event()
    model = ScriptedModel([[Text("one")], [Wait(go), Text("two")]])
    async with Runtime(db(tmp_path), model=model) as rt:
        await (await rt.send("c", "pay invoice 42", key="k1")).result()
        with pytest.raises(IdempotencyConflict):
            await rt.send("c", "pay invoice 43", key="k1")
        second = await rt.send("c", "pay invoice 44", key="k2")  # streams until `go`
        with pytest.raises(IdempotencyConflict):  # refused on the mid-turn path too
            await rt.send("c", "pay invoice 45", key="k2")
        with pytest.raises(IdempotencyConflict):
            await rt.send("c", "pay invoice 46", key="k1")
        again = await rt.send("c", "pay invoice 44", key="k2")
        assert again.user_position == second.user_position
        go.set()
        assert (await second.result()).text == "two"
        users = [e.body.text for e in await log_of(rt, "c") if isinstance(e.body, UserMessage)]
        assert users == ["pay invoice 42", "pay invoice 44"]
        assert (await rt.admin.stats()).crashes == 0


async def test_resolve_and_cancel_on_an_unknown_conversation_leave_nothing_in_memory(
    tmp_path: Path,
) -> None:
    async with Runtime(db(tmp_path)) as rt:
        for i in range(100):
            with pytest.raises(UnknownConversation):
                await rt.resolve(f"ghost-{i}", "call-1", "yes")
            assert await rt.cancel(f"ghost-{i}") is False
        assert len(rt._registry) == 0
        assert rt._host.followers_by_id == {}
        assert await rt.store.conversations() == []
        stats = await rt.admin.stats()
        assert stats.activations == 0 and stats.live == 0


async def test_an_external_call_breaking_its_schema_is_answered_with_an_error(
    tmp_path: Path,
) -> None:
    model = ScriptedModel([
        [Call("approve", {"amount": "lots"}, id="bad-1"), Call("approve", {}, id="bad-2")],
        [Call("approve", {"amount": 3}, id="good")],
        [Text("approved")],
    ])
    async with Runtime(db(tmp_path), model=model, agent=AgentConfig(tools=[APPROVE])) as rt:
        turn = await rt.send("c", "pay")
        suspended = await turn.result()
        # The broken calls never suspended the turn; the model fixed its call and waits.
        assert isinstance(suspended, Suspended) and suspended.call_ids == ("good",)
        results = [e.body for e in await log_of(rt, "c") if isinstance(e.body, ToolResult)]
        assert [(r.call_id, r.is_error) for r in results] == [("bad-1", True), ("bad-2", True)]
        assert "amount" in results[0].content and "integer" in results[0].content
        assert "required" in results[1].content
        seen = [m for m in model.calls[1] if isinstance(m, ToolResult)]
        assert [(m.call_id, m.is_error) for m in seen] == [("bad-1", True), ("bad-2", True)]
        assert [p.conversation_id for p in await rt.admin.pending()] == ["c"]
        continuation = await rt.resolve("c", "good", "yes")
        assert continuation is not None and (await continuation.result()).text == "approved"


# -- item 6: a store that cannot write is the infrastructure's fault --------------------------

BIG = "words that take room " * 1000  # ~20 KB: an append that needs new pages


class Answers:
    """Echoes, except that one question stalls until the test lets it answer at length."""

    name = "answers"

    def __init__(self) -> None:
        self.reached = anyio.Event()
        self.go = anyio.Event()

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        last = context[-1]
        text = last.text if isinstance(last, UserMessage) else ""
        if text == "a long answer, please":
            self.reached.set()
            await self.go.wait()
            yield TextDelta(BIG)
            return
        yield TextDelta(f"echo: {text}")


def _page_count(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA page_count").fetchone()[0])


def _max_page_count(conn: sqlite3.Connection, pages: int) -> int:
    return int(conn.execute(f"PRAGMA max_page_count = {pages}").fetchone()[0])


@pytest.fixture(params=["full", "read-only"])
def writes_fail(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """``(fail, recover)`` for a runtime's SQLite store: SQLite's ``max_page_count`` (the
    file cannot grow), or the file and its WAL made immutable (``chattr +i``, refused even
    to root; skipped where the filesystem or the process cannot set it)."""
    if request.param == "full":

        async def fail(rt: Runtime) -> None:
            store: Any = rt.store
            pages = await store._on_writer(_page_count)
            assert await store._on_writer(_max_page_count, pages) == pages

        async def recover(rt: Runtime) -> None:
            await rt.store._on_writer(_max_page_count, 1 << 30)  # type: ignore[attr-defined]

        yield fail, recover
        return
    chattr = shutil.which("chattr")
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    if chattr is None or subprocess.run([chattr, "+i", probe], capture_output=True).returncode:
        pytest.skip("cannot set the immutable attribute here (chattr, ext4 and root needed)")
    subprocess.run([chattr, "-i", probe], check=True)
    files = [tmp_path / "log.db", tmp_path / "log.db-wal"]  # not -shm: it is mapped

    async def make_immutable(rt: Runtime) -> None:
        await anyio.run_process([chattr, "+i", *map(str, files)])

    async def make_writable(rt: Runtime) -> None:
        await anyio.run_process([chattr, "-i", *map(str, files)])

    try:
        yield make_immutable, make_writable
    finally:
        subprocess.run([chattr, "-i", *map(str, files)], capture_output=True)


async def test_a_store_that_cannot_write_is_not_a_crash_and_the_runtime_recovers_by_itself(
    tmp_path: Path, writes_fail: Any
) -> None:
    fail, recover = writes_fail
    model = Answers()
    config = RuntimeConfig(max_restarts=1, backoff_initial=0.001, backoff_max=0.01)
    conversations = [f"c{i}" for i in range(5)]
    async with Runtime(db(tmp_path), model=model, config=config) as rt:
        for conv in conversations:
            assert (await (await rt.send(conv, "hello")).result()).text == "echo: hello"
        stalled = await rt.send("s", "a long answer, please")
        await model.reached.wait()

        await fail(rt)
        model.go.set()
        with anyio.fail_after(20):  # every request completes, with a result or an error
            with pytest.raises(StoreUnavailable):
                await stalled.result()  # its final commit failed: the caller is told so
            for _ in range(4):  # many times past max_restarts: none of it is a crash
                for conv in [*conversations, "s"]:
                    with pytest.raises(StoreUnavailable):
                        await rt.send(conv, BIG)
        # Reads go on meanwhile.
        for conv in conversations:
            assert [e.position for e in await log_of(rt, conv)] == [0, 1]
            assert [h.position for h in await rt.recall(conv, "hello")] == [0, 1]
            assert (await rt.admin.inspect(conv)).head == 1
        assert (await rt.admin.inspect("s")).state != "parked"
        assert await rt.admin.pending() == []
        stats = await rt.admin.stats()
        assert stats.crashes == 0 and stats.parks == 0 and stats.restarts == 0
        assert stats.store_failures >= 1
        assert await rt.admin.agents("parked") == []

        await recover(rt)  # no restart of the runtime: it serves again by itself
        with anyio.fail_after(20):
            for conv in [*conversations, "s"]:
                assert (await (await rt.send(conv, "after")).result()).text == "echo: after"
        for conv in conversations:  # nothing partial was written
            users = [e.body for e in await log_of(rt, conv) if isinstance(e.body, UserMessage)]
            assert users == [UserMessage("hello"), UserMessage("after")]
        log = await log_of(rt, "s")
        bodies = [e.body for e in log]
        assert bodies[0] == UserMessage("a long answer, please")
        assert isinstance(bodies[1], Aborted) and bodies[1].reason == "interrupted"
        assert bodies[2:] == [UserMessage("after"), AssistantMessage("echo: after")]
        assert [e.turn for e in log] == [1, 1, 2, 2]
        stats = await rt.admin.stats()
        assert stats.crashes == 0 and stats.parks == 0
        assert {a.state for a in await rt.admin.agents()} == {"awaiting_input"}


# -- item 8: a tool that ignores cancellation, a model that stalls ----------------------------


class Stubborn:
    """A tool that swallows every cancellation until the test lets it go."""

    def __init__(self) -> None:
        self.release = False
        self.started = anyio.Event()
        self.tasks: list[asyncio.Task[Any]] = []
        self.wake = asyncio.Event()

    async def run(self) -> str:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.append(task)
        self.started.set()
        while not self.release:
            with contextlib.suppress(BaseException):  # hostile: cancellation is ignored
                await self.wake.wait()
        return "finally done"

    async def let_go(self) -> None:
        """End every abandoned copy, so the test's loop closes clean."""
        self.release = True
        self.wake.set()
        if self.tasks:
            await asyncio.wait(self.tasks)


@pytest.fixture
async def stubborn() -> AsyncIterator[Stubborn]:
    hostile = Stubborn()
    try:
        yield hostile
    finally:
        await hostile.let_go()


def stubborn_tool(hostile: Stubborn, timeout: float | None = None) -> torpor.LocalTool:
    async def stubborn() -> str:
        """Never stops."""
        return await hostile.run()

    return torpor.tool(stubborn, timeout=timeout)


async def test_a_tool_ignoring_its_timeout_is_abandoned_and_the_model_gets_an_error(
    tmp_path: Path, stubborn: Stubborn
) -> None:
    model = ScriptedModel([[Call("stubborn", {}, id="t1")], [Text("went on without it")]])
    config = AgentConfig(tools=[stubborn_tool(stubborn)], tool_timeout=0.05, cancel_deadline=0.2)
    async with Runtime(db(tmp_path), model=model, agent=config) as rt:
        with anyio.fail_after(20):
            final = await (await rt.send("c", "use the tool")).result()
        assert final.text == "went on without it"
        (result,) = [e.body for e in await log_of(rt, "c") if isinstance(e.body, ToolResult)]
        assert result.is_error and "timed out" in result.content
        stats = await rt.admin.stats()
        assert stats.abandoned == 1 and stats.crashes == 0
        assert len(rt._host.abandoned) == 1  # owned by the runtime, reported
    assert not stubborn.tasks[0].done()  # abandoned, not awaited: still running


async def test_cancel_takes_effect_while_a_tool_ignores_cancellation(
    tmp_path: Path, stubborn: Stubborn
) -> None:
    model = ScriptedModel([[Text("let me see"), Call("stubborn", {}, id="t1")], [Text("next")]])
    config = AgentConfig(tools=[stubborn_tool(stubborn)], tool_timeout=600, cancel_deadline=0.2)
    async with Runtime(db(tmp_path), model=model, agent=config) as rt:
        turn = await rt.send("c", "use the tool")
        with anyio.fail_after(20):
            await stubborn.started.wait()
            assert (await rt.admin.inspect("c")).state == "running_tools"
            assert await rt.cancel("c") is True
            with pytest.raises(TurnAborted) as info:
                await turn.result()
        assert info.value.reason == "cancelled"
        last = (await log_of(rt, "c"))[-1].body
        assert isinstance(last, Aborted) and last.reason == "cancelled"
        assert (await rt.admin.stats()).abandoned == 1
        with anyio.fail_after(20):
            assert (await (await rt.send("c", "again")).result()).text == "next"


@pytest.mark.parametrize("cancel_deadline", [0.1, 30.0])
async def test_leaving_the_runtime_completes_while_a_tool_ignores_cancellation(
    tmp_path: Path, stubborn: Stubborn, cancel_deadline: float
) -> None:
    """Either the tool is abandoned within the agent's cancel deadline, or (a deadline
    longer than the runtime's) the agent task itself is abandoned at shutdown_deadline."""
    model = ScriptedModel([[Call("stubborn", {}, id="t1")]])
    config = AgentConfig(
        tools=[stubborn_tool(stubborn)], tool_timeout=600, cancel_deadline=cancel_deadline
    )
    rt = Runtime(db(tmp_path), model=model, agent=config,
                 config=RuntimeConfig(shutdown_deadline=0.2))
    with anyio.fail_after(20):
        async with rt:
            turn = await rt.send("c", "use the tool")
            await stubborn.started.wait()
    stats = await rt.admin.stats()
    assert stats.abandoned >= 1
    assert not stubborn.tasks[0].done()
    abandoned_agent_tasks = [t for t in rt._host.abandoned if t not in stubborn.tasks]
    await stubborn.let_go()  # the tool stops; an abandoned agent task then ends as well
    if abandoned_agent_tasks:
        await asyncio.wait(abandoned_agent_tasks)
    with pytest.raises(TurnAborted):
        await turn.result()
    if cancel_deadline < 0.2:  # the agent stopped in time and logged how the turn ended
        async with Runtime(db(tmp_path)) as again:
            last = (await log_of(again, "c"))[-1].body
            assert isinstance(last, Aborted) and last.reason == "shutdown"
    else:
        assert abandoned_agent_tasks


async def test_a_model_stream_that_stalls_past_the_idle_timeout_ends_the_turn(
    tmp_path: Path,
) -> None:
    never = anyio.Event()
    model = ScriptedModel([[Text("half an "), Wait(never), Text("answer")], [Text("back")]])
    config = AgentConfig(model_idle_timeout=0.2)
    async with Runtime(db(tmp_path), model=model, agent=config) as rt:
        turn = await rt.send("c", "question")
        with anyio.fail_after(20):
            with pytest.raises(TurnAborted) as info:
                await turn.result()
        assert info.value.reason == "model_error"
        assert "ModelTimeout" in info.value.detail
        last = (await log_of(rt, "c"))[-1].body
        assert isinstance(last, Aborted) and last.reason == "model_error"
        assert "ModelTimeout" in last.detail and "0.2 seconds" in last.detail
        assert last.partial_text == "half an "
        (call,) = await rt.store.model_calls("c")
        assert call.error is not None and "ModelTimeout" in call.error
        with anyio.fail_after(20):
            assert (await (await rt.send("c", "again")).result()).text == "back"
        assert (await rt.admin.stats()).crashes == 0
