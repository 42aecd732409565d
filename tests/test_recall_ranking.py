"""Ranking: events holding more of the query's distinct terms first, a short one before a
long repetitive one (issue 25, item 1); recall leaves out its own calls (item 3). On
SQLite (in memory and on file) and PostgreSQL alike."""

from __future__ import annotations

import itertools
import json

import pytest
from recall_traces import FACT, topical_conversation
from store_backends import AnyStore

from torpor.compaction.recall import recall
from torpor.events import AssistantMessage, ToolCall, ToolResult, UserMessage
from torpor.store.protocol import SearchHit


async def _append(store: AnyStore, turns: list[list[object]]) -> None:
    batch: list[object] = []
    for turn in turns:  # a few turns per append: the order and turns are what matter
        batch.extend(turn)
        if len(batch) >= 40:
            await store.append("c", batch)  # type: ignore[arg-type]
            batch = []
    if batch:
        await store.append("c", batch)  # type: ignore[arg-type]


async def _fact_among_filler(
    store: AnyStore, filler: str, fact: str, query: str
) -> list[SearchHit]:
    """Sixty long turns of ``filler`` with ``fact`` at position 30: recall's top five for
    ``query``, asserted to rank the fact first."""
    turns = [UserMessage(f"Turn {n}: " + filler * 4) for n in range(60)]
    turns.insert(30, UserMessage(fact))
    await _append(store, [[turn] for turn in turns])
    hits = await recall(store, "c", query, k=5)
    assert hits[0].position == 30, [(h.position, h.score) for h in hits]
    return hits


@pytest.mark.parametrize("events", [102, 2_402])
async def test_a_short_fact_holding_every_common_query_word_ranks_first(
    store: AnyStore, events: int
) -> None:
    at = events // 3
    await _append(store, topical_conversation(events, {at: UserMessage(FACT)}))
    hits = await recall(store, "c", "billing cutover", k=10)
    assert hits[0].position == at and hits[0].score == 1.0
    assert "owned by Dana Whitfield" in hits[0].snippet


async def test_recall_leaves_out_the_agents_own_recall_calls(store: AnyStore) -> None:
    query = "staging database port"
    await store.append("c", [UserMessage("The staging database listens on port 6432.")])
    calls = []
    for n in range(6):  # the agent searched for it again and again
        call = ToolCall(f"r{n}", "recall", {"query": query})
        at = await store.append("c", [
            AssistantMessage("", (call,)),
            ToolResult(f"r{n}", "recall", f"1 match(es): event 0 {query} 6432"),
        ])
        calls.append(at[0])
    mixed = ToolCall("m", "recall", {"query": query})
    said = await store.append("c", [AssistantMessage("Checking the staging database.", (mixed,))])
    hits = await recall(store, "c", query, k=10)
    assert hits[0].position == 0 and hits[0].score == 1.0
    assert not {h.position for h in hits} & set(calls)
    # A message with words of its own stays, scored on those words, not on the call.
    mine = [h for h in hits if h.position == said[0]]
    assert len(mine) == 1 and mine[0].score < 1.0 and "recall" not in mine[0].snippet
    asked = await recall(store, "c", query, k=20, include_recall_outputs=True)
    assert set(calls) <= {h.position for h in asked}


async def test_a_large_json_results_snippet_shows_the_record_holding_most_query_words(
    store: AnyStore,
) -> None:
    records = [
        {"id": f"svc-{n}", "service": "billing", "region": "eu-west-1", "owner": "ops team"}
        for n in range(400)
    ]
    records[313] = {"id": "svc-313", "service": "payments", "region": "eu-north-1",
                    "owner": "Dana Whitfield"}
    content = json.dumps(records)
    assert len(content) > 30_000
    await store.append("c", [ToolResult("t", "inventory", content)])
    hits = await recall(store, "c", "payments region owner", k=3)
    assert hits[0].score == 1.0
    assert '"svc-313"' in hits[0].snippet or "Dana Whitfield" in hits[0].snippet
    assert "payments" in hits[0].snippet and "eu-north-1" in hits[0].snippet


async def test_rare_query_words_outweigh_common_ones(store: AnyStore) -> None:
    # The question's common words ("which", "the", "key", "closed", "incident") fill every
    # long turn by chance; the fact holds only its rare ones and "key". Counting the
    # distinct terms held ranks every long turn first; weighing each by its rarity in
    # the conversation ranks the fact first (issue 25, Table 1's prose 2-hop).
    filler = (
        "which key did the team check when the incident review closed the loop on the "
        "dashboard, the key metrics, the incident notes and the rota for the week; "
    )
    hits = await _fact_among_filler(store, filler, "Catalog cutover: rotated key K-7731.",
                                    "Which key closed the catalog cutover incident?")
    assert "K-7731" in hits[0].snippet
    # The score is still the plain share of the query's terms, never rising down the list.
    assert hits[0].score == pytest.approx(3 / 7, abs=1e-6)
    assert all(a.score >= b.score for a, b in itertools.pairwise(hits))


async def test_query_words_held_together_outrank_the_same_words_apart(store: AnyStore) -> None:
    # Every word of the question is common here: long turns hold four of them apart by
    # chance, the fact three, side by side as the question writes them. Adjacent pairs
    # of query words weigh too (rare as pairs), so the fact ranks first.
    filler = (
        "the mailer dashboards were slow and the key review went fine; an incident "
        "drill ran after the migration plan was read by the team; "
    )
    fact = "The mailer migration incident is tracked in OPS-4821."
    hits = await _fact_among_filler(store, filler, fact, "key closed mailer migration incident")
    assert "OPS-4821" in hits[0].snippet
    assert hits[0].score == pytest.approx(3 / 5, abs=1e-6)  # pairs rank; they do not score
