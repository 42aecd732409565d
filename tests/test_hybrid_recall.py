"""Hybrid recall: vectors beside the events, fused with full-text search (issue 13).

Real SQLite and the real throwaway PostgreSQL cluster (no pgvector there: the
``real[]`` brute-force path), the deterministic HashingEmbedder.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import anyio
import pytest
from store_backends import Backend

import torpor
from torpor import Runtime, RuntimeConfig
from torpor.compaction.fusion import RRF_K, fuse
from torpor.compaction.recall import recall
from torpor.events import UserMessage
from torpor.llm import HashingEmbedder
from torpor.llm.scripted import Call, ScriptedModel, Text
from torpor.store.vectors import vector_index

FACT = "We rolled back the billing deploy on Tuesday."
PARAPHRASE = "deployment rollback"  # shares no token with FACT: full text cannot find it


def url_of(backend: Backend) -> str:
    return f"sqlite:///{backend.location}" if backend.name == "sqlite" else str(backend.location)


class CountingEmbedder(HashingEmbedder):
    """The hashing embedder, counting the texts it was asked for; can be made to fail."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []
        self.failing = False
        self.held: asyncio.Event | None = None  # set: texts naming the canary wait for it

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if self.failing:
            raise torpor.ModelOverloaded("embedder down", provider="test")
        if self.held is not None and any("canary" in text for text in texts):
            await self.held.wait()  # the worker's batch, not a query's
        self.texts.extend(texts)
        return await super().embed(texts)


# -- fusion -------------------------------------------------------------------------------


def test_reciprocal_rank_fusion_adds_one_over_k_plus_rank_across_lists() -> None:
    fused = fuse([[10, 20, 30], [30, 40]])
    scores = dict(fused)
    assert scores[10] == pytest.approx(1 / (RRF_K + 1))
    assert scores[30] == pytest.approx(1 / (RRF_K + 3) + 1 / (RRF_K + 1))
    assert fused[0][0] == 30  # in both lists: beats a first place in one
    # 20 and 40 tie (second in one list each): the newer position first.
    assert [p for p, _ in fused] == [30, 10, 40, 20]


def test_the_hashing_embedder_is_deterministic_and_relates_shared_spelling() -> None:
    a, b = HashingEmbedder(), HashingEmbedder()
    assert a.vector(FACT) == b.vector(FACT)
    q = a.vector("deploying billing")

    def cos(x: list[float], y: list[float]) -> float:
        return sum(i * j for i, j in zip(x, y, strict=True))

    assert cos(q, a.vector("deployment of billing")) > cos(q, a.vector("lunch at noon")) + 0.3
    with pytest.raises(torpor.ConfigError):
        HashingEmbedder(0)


def test_a_runtime_refuses_an_object_that_is_not_an_embedder() -> None:
    with pytest.raises(torpor.ConfigError, match="embedder"):
        RuntimeConfig(embedder=object())
    assert RuntimeConfig().embedder is None  # off by default


# -- the vector index on each backend ------------------------------------------------------


async def test_vectors_are_kept_per_space_and_the_mark_only_moves_forward(
    backend: Backend,
) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage(f"m{i}") for i in range(4)])
        index = vector_index(store)
        assert await index.lagging("s/2", 10) == [("c", -1)]
        await index.put("c", "s/2", [(0, [1.0, 0.0]), (1, [0.0, 2.0]), (2, [1.0, 1.0])], 2)
        await index.put("c", "s/2", [(0, [0.0, 1.0])], 1)  # kept: the first vector stays
        await index.put("c", "t/2", [(3, [1.0, 0.0])], 3)  # another space
        assert await index.progress("c", "s/2") == 2
        assert await index.lagging("s/2", 10) == [("c", 2)]
        assert await index.lagging("t/2", 10) == []
        near = await index.nearest("c", "s/2", [3.0, 0.0], 2)
        assert [p for p, _ in near] == [0, 2]
        assert near[0][1] == pytest.approx(1.0, abs=1e-6)
        assert near[1][1] == pytest.approx(2**-0.5, abs=1e-6)
        assert [p for p, _ in await index.nearest("c", "t/2", [0.0, 1.0], 5)] == [3]
        assert await index.nearest("nobody", "s/2", [1.0, 0.0], 5) == []
        await index.put("nobody", "s/2", [(0, [1.0, 0.0])], 0)  # no conversation: nothing
        assert await index.progress("nobody", "s/2") == -1
        assert index.backend in ("python", "sqlite-vec", "sql", "pgvector")
    async with backend.open() as store:  # vectors and marks are in the database
        index = vector_index(store)
        assert await index.progress("c", "s/2") == 2
        assert [p for p, _ in await index.nearest("c", "s/2", [0.0, 1.0], 1)] == [1]


# -- the runtime ---------------------------------------------------------------------------


async def test_hybrid_recall_finds_a_paraphrase_full_text_cannot(
    backend: Backend,
) -> None:
    embedder = CountingEmbedder()
    config = RuntimeConfig(embedder=embedder, embed_interval=3600)
    noise = [f"note {i}: invoices for account {i} were sent" for i in range(15)]
    async with Runtime(url_of(backend), config=config) as rt:
        for text in [FACT, *noise]:
            await (await rt.send("c", text)).result()
        assert await recall(rt.store, "c", PARAPHRASE, 3) == []  # full text alone
        stats = await rt.admin.embed()
        assert stats is not None and stats.embedded == 32  # 16 user messages + 16 echoes
        hits = await rt.recall("c", PARAPHRASE, 3)
        assert "rolled back" in hits[0].snippet
        scores = [h.score for h in hits]
        assert all(0.0 <= s <= 1.0 for s in scores) and scores == sorted(scores, reverse=True)

        # The tail not embedded yet is covered by full text alone (the embedder is held,
        # so the worker woken by this append cannot catch up however slow the machine).
        embedder.held = asyncio.Event()
        await (await rt.send("c", "the canary hostname is zebra-7")).result()
        assert await vector_index(rt.store).progress("c", stats.space) < 33
        tail = await rt.recall("c", "zebra-7", 1)
        assert tail and tail[0].position >= 32
    # Restart: the marks are in the store, nothing embedded twice.
    embedder.texts.clear()
    embedder.held = None
    async with Runtime(url_of(backend), config=config) as rt:
        stats = await rt.admin.embed()
        assert stats is not None
        assert len(embedder.texts) == stats.embedded == 2  # only the last message and its echo


async def test_a_failing_embedder_costs_lag_not_recall(backend: Backend) -> None:
    embedder = CountingEmbedder()
    config = RuntimeConfig(embedder=embedder, embed_interval=3600)
    async with Runtime(url_of(backend), config=config) as rt:
        embedder.failing = True
        await (await rt.send("c", FACT)).result()
        stats = await rt.admin.embed()
        assert stats is not None
        assert stats.embedded == 0 and stats.failures >= 1
        assert stats.last_error is not None and "embedder down" in stats.last_error
        hits = await rt.recall("c", "billing", 5)  # the query cannot be embedded: full text
        assert {h.position for h in hits} == {0, 1}
        embedder.failing = False
        stats = await rt.admin.embed()
        assert stats is not None and stats.embedded == 2
        assert await rt.recall("c", PARAPHRASE, 1)


async def test_the_background_task_embeds_what_is_appended_and_stops_with_the_runtime() -> None:
    embedder = CountingEmbedder()
    # An hour between timed passes: what moves the mark is the worker being woken by appends.
    async with Runtime(config=RuntimeConfig(embedder=embedder, embed_interval=3600)) as rt:
        index = vector_index(rt.store)
        space = f"{embedder.name}/{embedder.dimensions}"
        for text, position in ((FACT, 1), ("and one more thing", 3)):
            await (await rt.send("c", text)).result()
            with anyio.fail_after(10):  # the worker moves the mark, not this test
                while await index.progress("c", space) < position:
                    await rt.store.head("c")  # a trip to the store yields to the worker
        worker = rt._embedding
        assert worker is not None
    assert worker.stats().passes >= 1


async def test_without_an_embedder_recall_is_full_text_and_admin_embed_is_none() -> None:
    async with Runtime() as rt:
        await (await rt.send("c", FACT)).result()
        assert await rt.admin.embed() is None
        assert rt._embedding is None
        assert {h.position for h in await rt.recall("c", "billing", 5)} == {0, 1}


async def test_the_models_recall_tool_is_hybrid_too() -> None:
    model = ScriptedModel([
        [Text("noted")],
        [Call("recall", {"query": PARAPHRASE}, id="r1")],
        [Text("found it")],
    ])
    config = RuntimeConfig(embedder=HashingEmbedder(), embed_interval=3600)
    async with Runtime("sqlite://", model=model, config=config) as rt:
        await (await rt.send("c", FACT)).result()
        await rt.admin.embed()
        await (await rt.send("c", "what happened to that deploy?")).result()
        results = [e.body for e in await rt.history("c", limit=100)
                   if isinstance(e.body, torpor.ToolResult)]
        assert "rolled back" in results[0].content  # full text alone finds nothing here
