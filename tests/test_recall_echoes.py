"""recall leaves out the outputs of earlier recall/expand calls unless asked (issue 13).

They quote other events, which are searchable themselves; a quote of a value since
corrected would otherwise come back as if it were evidence. The index is unchanged:
the filter applies at query time, on every backend.
"""

from __future__ import annotations

import pytest
from store_backends import AnyStore

from torpor import Runtime, ScriptedModel
from torpor.compaction.recall import RECALL_ECHOES, recall
from torpor.errors import InvalidInput
from torpor.events import AssistantMessage, ToolCall, ToolResult, UserMessage
from torpor.llm import Call, Text


def _quote(n: int) -> str:
    return "pool_size " * (2 + n % 2)


_PAD = " and other words" * 30  # real events longer than the echoes: the echoes rank first


async def _fill(store: AnyStore) -> tuple[set[int], set[int]]:
    """(positions of real events, positions of echoes), echoes ranked above the rest."""
    real = await store.append("c", [UserMessage("gateway pool_size = 32" + _PAD)])
    echoes: list[int] = []
    for n in range(12):  # more echoes than k, so a filtered search must read deeper
        tool = ("recall", "expand")[n % 2]
        call = ToolCall(f"r{n}", tool, {"start": n})
        at = await store.append("c", [AssistantMessage("", (call,)),
                                      ToolResult(f"r{n}", tool, _quote(n))])
        echoes.append(at[1])
    for n in range(4):
        real += await store.append("c", [UserMessage(f"pool_size note {n}{_PAD}")])
    real += await store.append("c", [ToolResult("x", "lookup", "pool_size = 48 pool_size" + _PAD)])
    return set(real), set(echoes)


async def test_a_search_leaves_out_the_named_tools_results_and_still_fills_k(
    store: AnyStore,
) -> None:
    real, echoes = await _fill(store)
    everything = await store.search("c", "pool_size", k=6)
    assert {h.position for h in everything} <= echoes  # the echoes rank first ...
    kept = await store.search("c", "pool_size", k=6, exclude_tools=RECALL_ECHOES)
    assert len(kept) == 6 and {h.position for h in kept} == real  # ... and are read past
    assert [h.score for h in kept] == sorted((h.score for h in kept), reverse=True)
    assert 0 < kept[0].score <= 1
    few = await store.search("c", "pool_size", k=50, exclude_tools=["recall"])
    assert {h.position for h in few} == real | {p for p in echoes if p % 4 == 0}  # expand
    with pytest.raises(InvalidInput, match="exclude_tools"):
        await store.search("c", "pool_size", exclude_tools="recall")


async def test_recall_leaves_echoes_out_by_default_and_includes_them_when_asked(
    store: AnyStore,
) -> None:
    real, echoes = await _fill(store)
    default = await recall(store, "c", "pool_size", k=20)
    assert {h.position for h in default} == real
    both = await recall(store, "c", "pool_size", k=20, include_recall_outputs=True)
    assert {h.position for h in both} == real | echoes


async def test_the_model_tool_and_rt_recall_leave_echoes_out_unless_asked() -> None:
    model = ScriptedModel(
        [
            [Call("recall", {"query": "pool_size"}, id="a")],
            [Text("first")],
            [Call("recall", {"query": "pool_size"}, id="b")],
            [Text("second")],
            [Call("recall", {"query": "pool_size", "include_recall_outputs": True}, id="c")],
            [Text("third")],
            [Call("recall", {"query": "pool_size", "include_recall_outputs": "yes"}, id="d")],
            [Text("fourth")],
        ]
    )
    async with Runtime("sqlite://", model=model) as rt:
        await (await rt.send("c", "gateway pool_size = 32")).result()  # recalls: echo at 2
        await (await rt.send("c", "again")).result()
        await (await rt.send("c", "and with quotes")).result()
        await (await rt.send("c", "badly")).result()
        history = list(reversed(await rt.history("c")))
        results = {e.body.call_id: e for e in history if isinstance(e.body, ToolResult)}
        first = results["a"].position
        assert f"event {first} " not in results["b"].body.content
        assert f"event {first} " in results["c"].body.content
        assert results["d"].body.is_error and "include_recall_outputs" in results["d"].body.content
        assert first not in {h.position for h in await rt.recall("c", "pool_size")}
        quoted = await rt.recall("c", "pool_size", include_recall_outputs=True)
        assert first in {h.position for h in quoted}
        with pytest.raises(InvalidInput):
            await rt.recall("c", "pool_size", include_recall_outputs=1)  # type: ignore[arg-type]


async def test_an_old_value_comes_back_beside_its_correction(store: AnyStore) -> None:
    await store.append("c", [UserMessage("gateway-7.pool_size = 32, agreed at the design review")])
    for n in range(5):
        await store.append("c", [UserMessage(f"unrelated chatter {n}")])
    await store.append("c", [UserMessage("Correction: gateway-7.pool_size = 48.")])
    await store.append("c", [UserMessage("later: cache-2.ttl = 5 at the design review")])
    hits = await recall(store, "c", "design review", k=5)
    positions = [h.position for h in hits]
    assert positions[:2] == [6, 0] or positions[-2:] == [6, 0]  # the correction, then it
    corrected = hits[positions.index(6)]
    assert corrected.score == hits[positions.index(0)].score and "48" in corrected.snippet
    assert positions.count(6) == 1 and 7 in positions  # nothing earlier, nothing twice
    plain = await recall(store, "c", "design review", k=5, follow_corrections=False)
    assert sorted(h.position for h in plain) == [0, 7]
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True)
