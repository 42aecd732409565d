"""A delete racing the runtime's background work leaves nothing behind (runtime.erase).

Each interleaving is forced with events: the embedding pass held inside its embedder,
the consolidation sweep held inside its judge, a sub-agent held inside its model. The
delete cancels guarded background work and waits for it, so nothing it would have
written lands after the delete, not even in a conversation started afresh under the
same id; it stops exactly the agents of the conversations the store deletes (a
sub-agent tree, not every id under the same prefix); a deleted child answers its
parent's call with an error, and a deleted parent takes its children with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from torpor import (
    AgentConfig,
    AssistantMessage,
    ConversationDeleted,
    Event,
    ExternalTool,
    Runtime,
    RuntimeConfig,
    Suspended,
    ToolResult,
)
from torpor.llm import HashingEmbedder
from torpor.llm.scripted import Call, ScriptedModel, Signal, Text, Wait
from torpor.memory import KeyedConsolidator
from torpor.store.memory import MemoryRecord, SemanticItem
from torpor.store.vectors import vector_index

SECRET = "canary zebra umbrella"


def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'log.db'}"


class HeldEmbedder(HashingEmbedder):
    """Texts naming the canary wait in ``embed`` (the worker's batch) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if any("canary" in text for text in texts):
            self.entered.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        return await super().embed(texts)


async def test_an_embedding_pass_racing_a_delete_writes_no_vector_after_it(
    tmp_path: Path,
) -> None:
    embedder = HeldEmbedder()
    config = RuntimeConfig(embedder=embedder, embed_interval=3600)
    agent = AgentConfig(model=ScriptedModel([[Text("noted")], [Text("hi")]]))
    async with Runtime(db(tmp_path), config=config, agent=agent) as rt:
        worker = rt._embedding
        assert worker is not None
        await (await rt.send("c", f"remember {SECRET}")).result()
        await embedder.entered.wait()  # the pass holds the secret's text now
        assert await rt.delete("c") is True
        assert embedder.cancelled  # the delete ended the pass's step before returning
        # The id starts afresh; the held batch is let go; a pass runs to its end.
        await (await rt.send("c", "a fresh start")).result()
        embedder.release.set()
        await worker.catch_up()
        index = vector_index(rt.store)
        stale = await index.nearest("c", worker.space, embedder.vector(f"remember {SECRET}"), 5)
        assert all(similarity < 0.99 for _, similarity in stale), stale
        fresh = await index.nearest("c", worker.space, embedder.vector("a fresh start"), 1)
        assert fresh[0][0] == 0 and fresh[0][1] > 0.99  # the new message has its own


class HeldJudge(KeyedConsolidator):
    """The default sweep, held between reading the memory and answering."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False

    async def sweep(self, conversation_id: str, memory: MemoryRecord) -> list:  # type: ignore[type-arg]
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return await super().sweep(conversation_id, memory)


async def test_a_consolidation_sweep_racing_a_delete_records_nothing(tmp_path: Path) -> None:
    judge = HeldJudge()
    agent = AgentConfig(model=ScriptedModel([[Text("ok")], [Text("ok")]]), consolidator=judge)
    facts = [SemanticItem(1, 0, "city", "fact", "Paris"), SemanticItem(1, 1, "city", "fact",
                                                                         "Lyon")]
    async with Runtime(db(tmp_path), agent=agent) as rt:
        await (await rt.send("c", "I live in Lyon")).result()
        await rt.store.put_memory("c", facts=facts)
        sweep = asyncio.ensure_future(rt.consolidate("c"))
        await judge.entered.wait()
        assert await rt.delete("c") is True
        assert judge.cancelled  # ended before the delete returned
        with pytest.raises(ConversationDeleted):
            await sweep
        # A conversation started afresh under the id, with items of the same ids: the
        # cancelled sweep's decisions (about the deleted items) are not in its ledger.
        await (await rt.send("c", "I live in Rome")).result()
        await rt.store.put_memory("c", facts=facts)
        judge.release.set()
        assert (await rt.memory("c")).record.ledger == ()
        with pytest.raises(ConversationDeleted):  # and a sweep during a delete is refused
            rt._erasure.deleting["c"] = asyncio.get_running_loop().create_future()
            try:
                await rt.consolidate("c")
            finally:
                del rt._erasure.deleting["c"]


RESEARCH = ExternalTool("research", "ask a sub-agent")


def parent_config(*answers: str) -> AgentConfig:
    steps: list[object] = [[Call("research", {"q": "x"}, id="r1")]]
    steps += [[Text(a)] for a in answers]
    return AgentConfig(model=ScriptedModel(steps), tools=[RESEARCH], recall_tools=False)


def held_config(gate: anyio.Event, started: anyio.Event | None = None) -> AgentConfig:
    steps: list[object] = [Signal(started)] if started is not None else []
    return AgentConfig(model=ScriptedModel([[*steps, Wait(gate), Text("late")]]),
                       recall_tools=False)


async def _suspended(rt: Runtime, parent: str) -> int:
    outcome = await (await rt.send(parent, "go")).result()
    assert isinstance(outcome, Suspended) and outcome.call_ids == ("r1",)
    head = await rt.store.head(parent)
    assert head is not None
    return head


async def _answer(rt: Runtime, conversation: str, after: int) -> AssistantMessage:
    with anyio.fail_after(20):  # a bound on a hang, not a synchronisation
        async with rt.subscribe(conversation, after=after) as follower:
            async for item in follower:
                if isinstance(item, Event) and isinstance(item.body, AssistantMessage) \
                        and not item.body.tool_calls:
                    return item.body
    raise AssertionError("the follower ended")


async def test_a_deleted_child_answers_its_parents_call_with_an_error(tmp_path: Path) -> None:
    gate = anyio.Event()
    async with Runtime(db(tmp_path), agent=parent_config("parent goes on")) as rt:
        head = await _suspended(rt, "p")
        child = await rt.spawn("p", "r1", task="t", agent=held_config(gate))
        assert await rt.delete(child) is True
        assert (await _answer(rt, "p", head)).text == "parent goes on"
        results = [e.body for e in await rt.history("p", limit=100)
                   if isinstance(e.body, ToolResult)]
        assert [(r.call_id, r.is_error) for r in results] == [("r1", True)]
        assert "deleted" in results[0].content
        assert await rt.store.head(child) is None


async def test_a_deleted_parent_takes_its_children_and_only_them(tmp_path: Path) -> None:
    gate, other_gate, other_started = anyio.Event(), anyio.Event(), anyio.Event()

    def configs(conversation_id: str) -> AgentConfig:
        if conversation_id == "p/other":  # under the parent's prefix, but no sub-agent
            return held_config(other_gate, other_started)
        return parent_config("never")

    async with Runtime(db(tmp_path), agent_for=configs) as rt:
        await _suspended(rt, "p")
        child = await rt.spawn("p", "r1", task="t", agent=held_config(gate))
        assert child == "p/r1"
        other = await rt.send("p/other", "a conversation of its own")
        await other_started.wait()  # its turn is in its model call
        assert await rt.store.subtree("p") == ["p", child]

        assert await rt.delete("p") is True

        assert await rt.store.head("p") is None and await rt.store.head(child) is None
        running = {a.conversation_id for a in await rt.admin.agents()}
        assert child not in running and "p" not in running
        assert not rt._branches._watchers  # the child's watcher went with its parent
        other_gate.set()  # "p/other" was not stopped: its turn answers
        outcome = await other.result()
        assert isinstance(outcome, AssistantMessage) and outcome.text == "late"
        assert {i.id for i in await rt.conversations()} == {"p/other"}
