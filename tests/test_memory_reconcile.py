"""Write reconciliation: the hot-path ADD/NONE per whole turn, the sweep's ledger, the digest."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Sequence

import anyio
import msgspec
import pytest
from store_backends import Backend

from torpor import (
    AgentConfig,
    ConfigError,
    InvalidInput,
    KeyedConsolidator,
    LedgerEntry,
    MemoryRecord,
    ModelSummarizer,
    Runtime,
    RuntimeConfig,
    ScriptedModel,
    SemanticItem,
    tool,
)
from torpor.events import Event, UserMessage
from torpor.llm import Call, Text
from torpor.memory.digest import write_digest
from torpor.memory.ledger import item_order
from torpor.store.memory import EpisodicItem

SMALL = dict(working_budget=150, tail_turns=1, context_window=4_000, max_output_tokens=500,
             safety_margin=100, recall_tools=False)


@tool
async def lookup(q: str) -> str:
    """Look something up."""
    return f"found {q} " + "x " * 20


class SkipNoise:
    """NONE for a turn whose user message says "noise"; remembers what it was shown."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[str]]] = []

    def decide(self, conversation_id: str, turn: int, events: Sequence[Event]) -> str:
        self.seen.append((turn, [e.kind for e in events]))
        first = events[0].body
        return "none" if isinstance(first, UserMessage) and "noise" in first.text else "add"


def words(tag: str) -> str:
    return f"{tag} " + " ".join(f"w{j}" for j in range(30))


async def test_none_skips_a_whole_turn_from_memory_and_never_from_the_log() -> None:
    # Turn 1 calls a tool (noise), the others answer directly.
    model = ScriptedModel([[Call("lookup", {"q": "zebra"})], [Text("looked")]]
                          + [[Text("ok")]] * 20)
    summarizer = ScriptedModel.replies("EPISODE:\nsummary\nITEMS:\n[]", loop=True)
    reconciler = SkipNoise()
    agent = AgentConfig(model=model, tools=[lookup], reconciler=reconciler,
                        summarizer=ModelSummarizer(summarizer), **SMALL)
    async with Runtime("sqlite://", agent=agent) as rt:
        await (await rt.send("c", words("noise zebra"))).result()
        for i in range(4):
            await (await rt.send("c", words(f"signal{i}"))).result()
        memory = await rt.store.memory("c")
        log = list(reversed(await rt.history("c", limit=1000)))
        hits = await rt.recall("c", "zebra")
    # Consulted once per finished turn, with the whole turn: the message, the call, its
    # result and the answer together (turn atomicity).
    assert reconciler.seen[0] == (1, ["user", "assistant", "tool_result", "assistant"])
    assert [turn for turn, _ in reconciler.seen] == [1, 2, 3, 4, 5]
    assert memory.skipped_turns == (1,)
    # The log is complete: the skipped turn is there, and recall still finds it.
    assert [e.kind for e in log if e.turn == 1] == ["user", "assistant", "tool_result",
                                                    "assistant"]
    assert hits and hits[0].turn == 1
    # The summarizer never saw the skipped turn; its episode lists the turns it covered.
    shown = "\n".join(call[1].text for call in summarizer.calls)
    assert summarizer.calls and "zebra" not in shown and "signal0" in shown
    assert all(1 not in episode.turns for episode in memory.episodes)


class Broken:
    def __init__(self, answer: object) -> None:
        self.answer = answer

    def decide(self, conversation_id: str, turn: int, events: Sequence[Event]) -> object:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def _none() -> str:
    return "none"


@pytest.mark.parametrize("answer", ["delete", "update", None, RuntimeError("boom"), "coroutine"])
async def test_a_reconciler_that_answers_out_of_turn_counts_as_add(
    answer: object, caplog: pytest.LogCaptureFixture
) -> None:
    if answer == "coroutine":  # an async decide hidden behind a plain one
        answer = _none()
    agent = AgentConfig(model=ScriptedModel.replies("ok", loop=True), reconciler=Broken(answer))
    with caplog.at_level(logging.WARNING, logger="torpor"):
        async with Runtime("sqlite://", agent=agent) as rt:
            assert (await (await rt.send("c", "hi")).result()).text == "ok"
            assert (await rt.store.memory("c")).skipped_turns == ()
    assert any("reconciler_" in r.getMessage() for r in caplog.records)
    if inspect.iscoroutine(answer):  # closed, not left to warn "never awaited" at exit
        assert inspect.getcoroutinestate(answer) == inspect.CORO_CLOSED


def test_a_reconciler_must_decide_synchronously_and_a_consolidator_sweep_async() -> None:
    class Async:
        async def decide(self, *args: object) -> str:
            return "add"

    class Sync:
        def sweep(self, *args: object) -> list[LedgerEntry]:
            return []

    with pytest.raises(ConfigError, match="reconciler"):
        AgentConfig(reconciler=Async())
    with pytest.raises(ConfigError, match="consolidator"):
        AgentConfig(consolidator=Sync())
    for bad in (True, float("nan"), -0.1, "0.5"):
        with pytest.raises(ConfigError, match="min_confidence"):
            KeyedConsolidator(min_confidence=bad)  # type: ignore[arg-type]


# -- the sweep and the ledger ------------------------------------------------------------


def fact(
    position: int, key: str, text: str, confidence: float = 0.8, ordinal: int = 0
) -> SemanticItem:
    return SemanticItem(position, ordinal, key, "fact", text, confidence=confidence)


async def test_consolidate_supersedes_by_key_in_the_ledger_and_never_touches_the_log() -> None:
    async with Runtime("sqlite://") as rt:
        await (await rt.send("c", "hello")).result()
        head = await rt.store.head("c")
        await rt.store.put_memory("c", facts=[fact(2, "db", "postgres 14"),
                                              fact(2, "owner", "ana", ordinal=1)])
        await rt.store.put_memory("c", facts=[fact(6, "db", "postgres 16")])
        done = await rt.consolidate("c")
        again = await rt.consolidate("c")
        view = await rt.memory("c")
        assert await rt.store.head("c") == head
    assert [(d.key, d.action, d.item, d.superseded) for d in done.decisions] == [
        ("db", "update", "6.0", ("2.0",))]
    assert again.decisions == ()  # already decided up to the newest item
    assert [f.text for f in view.standing] == ["ana", "postgres 16"]
    assert len(view.record.facts) == 3  # the superseded item is still stored
    assert "postgres 16" in done.digest.text and "postgres 14" not in done.digest.text


async def test_consolidate_returns_the_decisions_as_stored_with_their_seq_and_time() -> None:
    async with Runtime("sqlite://") as rt:
        await (await rt.send("c", "hello")).result()
        await rt.store.put_memory("c", facts=[fact(2, "db", "postgres 14"),
                                              fact(2, "os", "linux", ordinal=1)])
        await rt.store.put_memory("c", facts=[fact(6, "db", "postgres 16"),
                                              fact(6, "os", "bsd", ordinal=1)])
        done = await rt.consolidate("c")
        stored = (await rt.store.memory("c")).ledger
    assert [d.key for d in done.decisions] == ["db", "os"]
    assert done.decisions == stored  # the same seq and created_at the store gave them
    assert all(d.seq > 0 and d.created_at > 0 for d in done.decisions)
    assert done.decisions[0].seq < done.decisions[1].seq


class Forget:
    """Tombstones every key it is told to."""

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys
        self.called = anyio.Event()

    async def sweep(self, conversation_id: str, memory: MemoryRecord) -> list[LedgerEntry]:
        self.called.set()
        newest = {f.key: f for f in memory.facts}
        return [LedgerEntry(k, "delete", newest[k].id, reason="stale") for k in self.keys
                if k in newest]


async def test_a_tombstone_hides_a_key_until_a_newer_fact_comes() -> None:
    agent = AgentConfig(consolidator=Forget({"db"}))
    async with Runtime("sqlite://", agent=agent) as rt:
        await (await rt.send("c", "hello")).result()
        await rt.store.put_memory("c", facts=[fact(2, "db", "postgres 14"), ])
        done = await rt.consolidate("c")
        assert [d.action for d in done.decisions] == ["delete"]
        assert (await rt.memory("c")).standing == ()
        await rt.store.put_memory("c", facts=[fact(9, "db", "sqlite now")])
        assert [f.text for f in (await rt.memory("c")).standing] == ["sqlite now"]
        assert [e.action for e in (await rt.store.memory("c")).ledger] == ["delete"]


async def test_low_confidence_facts_are_tombstoned_by_the_keyed_sweep() -> None:
    agent = AgentConfig(consolidator=KeyedConsolidator(min_confidence=0.5))
    async with Runtime("sqlite://", agent=agent) as rt:
        await (await rt.send("c", "hello")).result()
        await rt.store.put_memory("c", facts=[fact(2, "guess", "maybe", 0.2),
                                              fact(2, "sure", "yes", 0.9, ordinal=1)])
        done = await rt.consolidate("c")
    assert [(d.key, d.action) for d in done.decisions] == [("guess", "delete")]


async def test_idle_conversations_are_swept_on_schedule() -> None:
    forget = Forget({"none"})
    summarizer = ScriptedModel.replies("EPISODE:\ns\nITEMS:\n[]", loop=True)
    agent = AgentConfig(model=ScriptedModel.replies("ok", loop=True), consolidator=forget,
                        summarizer=ModelSummarizer(summarizer), **SMALL)
    config = RuntimeConfig(consolidate_interval=0.01)
    async with Runtime("sqlite://", agent=agent, config=config) as rt:
        for i in range(4):  # enough to fold: only a conversation that folded is swept
            await (await rt.send("c", words(f"m{i}"))).result()
        with anyio.fail_after(10):
            await forget.called.wait()


class Hangs:
    """A sweep that never answers (a consolidator model call that hangs)."""

    def __init__(self) -> None:
        self.called = anyio.Event()

    async def sweep(self, conversation_id: str, memory: MemoryRecord) -> list[LedgerEntry]:
        self.called.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


async def test_a_hung_consolidation_is_bounded_counted_and_the_sweep_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hangs, forget = Hangs(), Forget({"none"})
    summarizer = ModelSummarizer(ScriptedModel.replies("EPISODE:\ns\nITEMS:\n[]", loop=True))
    configs = {
        name: AgentConfig(model=ScriptedModel.replies("ok", loop=True), consolidator=sweep,
                          summarizer=summarizer, model_idle_timeout=0.2, **SMALL)
        for name, sweep in (("stuck", hangs), ("fine", forget))
    }
    config = RuntimeConfig(consolidate_interval=0.01)
    with caplog.at_level(logging.WARNING, logger="torpor"):
        async with Runtime("sqlite://", agent_for=configs.__getitem__, config=config) as rt:
            for name in configs:  # "stuck" first: the sweep reaches it before "fine"
                for i in range(4):  # enough to fold: only a conversation that folded is swept
                    await (await rt.send(name, words(f"m{i}"))).result()
            with anyio.fail_after(10):
                await forget.called.wait()  # swept after the hung one was given up
            assert hangs.called.is_set()
            assert (await rt.admin.stats()).consolidation_failures >= 1
    assert any("consolidation_failed" in r.getMessage() and "stuck" in r.getMessage()
               for r in caplog.records)


async def test_no_sweep_runs_unless_scheduled() -> None:
    def sweepers() -> set[str]:
        return {t.get_name() for t in asyncio.all_tasks()} & {"torpor-consolidator"}

    forget = Forget(set())
    async with Runtime("sqlite://", agent=AgentConfig(consolidator=forget)) as rt:
        await (await rt.send("c", "hi")).result()
        assert rt.config.consolidate_interval is None
        assert sweepers() == set()  # nothing scheduled: no sweeper task at all
        assert not forget.called.is_set()
        await rt.consolidate("c")
    assert forget.called.is_set()  # on demand only
    scheduled = RuntimeConfig(consolidate_interval=3600)
    async with Runtime("sqlite://", config=scheduled, agent=AgentConfig(consolidator=forget)):
        assert sweepers() == {"torpor-consolidator"}
    assert sweepers() == set()  # stopped with the runtime


# -- the digest ---------------------------------------------------------------------------


def test_the_digest_is_bounded_and_demotes_the_least_important_instead_of_dropping() -> None:
    facts = [SemanticItem(1, i, f"k{i}", "fact", f"text {i}", confidence=i / 20)
             for i in range(20)]
    episodes = [EpisodicItem(10, 0, 9, (1,), "first episode\nwith two lines", salience=0.9)]
    digest = write_digest(facts, episodes, 8, link="memory:c")
    assert len(digest.lines) == 8
    assert digest.lines[-1] == "\u2026and 14 more: expand memory:c"
    assert len(digest.demoted) == 14
    shown = {line for line in digest.lines[:-1]}
    assert "- [events 0\u20139] first episode with two lines" in shown
    assert {f"- (fact) k{i}: text {i}" for i in range(14, 20)} <= shown  # the most confident
    assert {item for item, _ in digest.demoted} == {f"1.{i}" for i in range(14)}
    assert digest.demoted[-1] == ("1.0", "- (fact) k0: text 0")  # the least important last
    every = write_digest(facts, episodes, 100)
    assert len(every.lines) == 21 and every.demoted == ()
    assert write_digest(facts, episodes, 8, link="memory:c") == digest  # pure
    with pytest.raises(Exception, match="max_lines"):
        write_digest(facts, episodes, 0)


async def test_a_suspended_turn_is_decided_once_when_it_finally_ends() -> None:
    from torpor import ExternalTool

    model = ScriptedModel([[Call("approve", {}, id="a1")], [Text("approved")]])
    reconciler = SkipNoise()
    agent = AgentConfig(model=model, tools=[ExternalTool("approve")], reconciler=reconciler)
    async with Runtime("sqlite://", agent=agent) as rt:
        await (await rt.send("c", "noise: deploy?")).result()  # ends suspended
        assert reconciler.seen == []  # the turn is not over: nothing decided yet
        await rt.admin.hibernate("c")
        continuation = await rt.resolve("c", "a1", "yes")
        assert continuation is not None
        await continuation.result()
        skipped = (await rt.store.memory("c")).skipped_turns
    assert reconciler.seen == [
        (1, ["user", "assistant", "suspended", "tool_result", "resolved", "assistant"])]
    assert skipped == (1,)


async def test_sweeps_run_concurrently_with_folds_on_every_backend(backend: Backend) -> None:
    """Folds write items while sweeps write the ledger: every sweep sees a consistent
    snapshot, and the end state is what one final sweep decides."""
    url = backend.location if backend.postgres else f"sqlite:///{backend.location}"
    assert url is not None
    items = [{"kind": "fact", "key": "counter", "text": f"value {i}", "confidence": 0.9}
             for i in range(3)]
    replies = [f"EPISODE:\ne{i}\nITEMS:\n" + msgspec.json.encode(items[i:i + 1]).decode()
               for i in range(3)]
    summarizer = ScriptedModel.replies(*replies, loop=True)
    agent = AgentConfig(model=ScriptedModel.replies("ok", loop=True),
                        summarizer=ModelSummarizer(summarizer), **SMALL)
    decisions: list[LedgerEntry] = []
    async with Runtime(url, agent=agent) as rt:
        done = anyio.Event()

        async def talk() -> None:
            for i in range(8):
                await (await rt.send("c", words(f"m{i}"))).result()
            done.set()

        async def sweep() -> None:
            while not done.is_set():
                decisions.extend((await rt.consolidate("c")).decisions)

        async with anyio.create_task_group() as tg:
            tg.start_soon(talk)
            tg.start_soon(sweep)
        decisions.extend((await rt.consolidate("c")).decisions)
        view = await rt.memory("c")
        assert (await rt.consolidate("c")).decisions == ()
    facts = view.record.facts
    assert len(facts) >= 2 and all(f.key == "counter" for f in facts)
    newest = max(facts, key=lambda f: f.order)
    assert view.standing == (newest,)
    assert view.record.ledger[-1].item == newest.id
    # Every decision superseded only items older than the one it kept.
    for d in decisions:
        assert all(item_order(s) < item_order(d.item) for s in d.superseded)


async def test_a_decision_that_cannot_be_recorded_never_fails_the_logged_turn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from torpor.events import AssistantMessage
    from torpor.memory.reconcile import reconcile_logged
    from torpor.store import SQLiteStore

    async with SQLiteStore(None) as store:
        logged = await store.append_events("c", [UserMessage("noise"), AssistantMessage("ok")],
                                           turn=1)
        # A turn decision for a conversation the store does not know is refused (InvalidInput):
        # the events were logged, so the hook reports and goes on.
        ghost = [msgspec.structs.replace(e, conversation_id="ghost") for e in logged]
        with caplog.at_level(logging.WARNING, logger="torpor"):
            decided = await reconcile_logged(store, SkipNoise(), "ghost", 1, None, ghost)
        assert decided == "none"
        assert any("turn_decision_unrecorded" in r.getMessage() for r in caplog.records)
        # Not finished (no answer yet): not consulted at all.
        assert await reconcile_logged(store, SkipNoise(), "c", 1, None, logged[:1]) is None
        assert await reconcile_logged(store, SkipNoise(), "c", 1, None, logged) == "none"
        assert (await store.memory("c")).skipped_turns == (1,)


class Says:
    """A sweep that answers whatever it is given."""

    def __init__(self, answer: object) -> None:
        self.answer = answer

    async def sweep(self, conversation_id: str, memory: MemoryRecord) -> object:
        return self.answer


@pytest.mark.parametrize(("answer", "field"), [
    (None, "decisions"),
    ("delete everything", "decisions"),
    ([{"key": "db", "action": "delete", "item": "2.0"}], r"decisions\[0\]"),
    ([LedgerEntry("db", "delete", "99.0")], r"decisions\[0\]\.item"),  # never shown
    ([LedgerEntry("db", "delete", "2.1")], r"decisions\[0\]\.item"),  # another key's item
    ([LedgerEntry("db", "update", "2.0"),
      LedgerEntry("db", "update", "2.0", superseded=("2.1",))], r"decisions\[1\]\.superseded"),
])
async def test_a_sweep_answering_garbage_is_refused_whole_and_records_nothing(
    answer: object, field: str
) -> None:
    async with Runtime("sqlite://", agent=AgentConfig(consolidator=Says(answer))) as rt:
        await (await rt.send("c", "hello")).result()
        await rt.store.put_memory("c", facts=[fact(2, "db", "postgres 14"),
                                              fact(2, "owner", "ana", ordinal=1)])
        with pytest.raises(InvalidInput, match=field):
            await rt.consolidate("c")
        view = await rt.memory("c")
    assert view.record.ledger == () and len(view.standing) == 2


@pytest.mark.parametrize("max_lines", [1, 2, 5])
def test_the_digest_never_spans_more_lines_than_its_bound(max_lines: int) -> None:
    # Keys, texts, summaries and the link (a conversation id) may hold line breaks.
    facts = [SemanticItem(1, i, f"k{i}\nx", "fact", f"a\nb\r\n{i}\u2028c") for i in range(9)]
    episodes = [EpisodicItem(10, 0, 9, (1,), "one\ntwo\x85three")]
    digest = write_digest(facts, episodes, max_lines, link="memory:a\nb")
    assert len(digest.text.splitlines()) == len(digest.lines) == max_lines
    assert len(digest.demoted) == 10 - (max_lines - 1)  # nothing dropped


@pytest.mark.parametrize("hibernate", [False, True])
async def test_a_postponed_turn_is_decided_whole_and_apart_from_the_turn_it_waited_on(
    hibernate: bool,
) -> None:
    # Turn 2's message is logged inside turn 1 (position 3, between its suspension and its
    # result); each turn is still decided once, with its own events only.
    from torpor import ExternalTool

    model = ScriptedModel([[Call("approve", {}, id="a1")], [Text("approved")], [Text("2nd")]])
    reconciler = SkipNoise()
    agent = AgentConfig(model=model, tools=[ExternalTool("approve")], reconciler=reconciler)
    async with Runtime("sqlite://", agent=agent) as rt:
        await (await rt.send("c", "deploy?")).result()
        second = await rt.send("c", "noise while waiting")
        if hibernate:
            await rt.admin.hibernate("c")
        continuation = await rt.resolve("c", "a1", "yes")
        assert continuation is not None
        await continuation.result()
        await second.result()
        log = list(reversed(await rt.history("c", limit=100)))
        skipped = (await rt.store.memory("c")).skipped_turns
    assert [(e.turn, e.kind) for e in log][2:5] == [(1, "suspended"), (2, "user"),
                                                    (1, "tool_result")]
    assert reconciler.seen == [
        (1, ["user", "assistant", "suspended", "tool_result", "resolved", "assistant"]),
        (2, ["user", "assistant"])]
    assert skipped == (2,)
