"""Recall scores are on one 0-1 scale on every backend, so a threshold set once works on both.

The same corpus goes into a SQLite file and a PostgreSQL schema; the same queries
must give the same top hits, scores within :data:`TOLERANCE` of each other for
every hit both return, scores that never rise down either list (monotone with
each backend's own ranking), and the same hits above a threshold.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pg_cluster import fresh_schema

from torpor.events import AssistantMessage, Body, ToolCall, ToolResult, UserMessage
from torpor.store import EventStore, SQLiteStore
from torpor.store.fulltext import calibrated, coverage

TOLERANCE = 0.05
"""Most the two backends' scores for one hit may differ (the documented tolerance)."""

THRESHOLD = 0.75
"""A confidence gate, set once: 'the hit holds at least three quarters of my query'."""


def corpus() -> list[Body]:
    bodies: list[Body] = [
        UserMessage("The deploy of the payment service failed with an SSL certificate error."),
        AssistantMessage(
            "Let me read the nginx config.",
            (ToolCall("c1", "read_file", {"path": "deploy/nginx/ssl.conf"}),),
        ),
        ToolResult("c1", "read_file", "ssl_certificate /etc/ssl/payment.pem;\nlisten 443 ssl;"),
        UserMessage("Also the staging key is in ticket OPS-1234, remember it."),
        AssistantMessage("Noted: ticket OPS-1234 holds the staging key."),
        UserMessage("OPS-1234 says the staging key is 3f9a2c1e77b0."),
        UserMessage("The retry budget is retries=5 with backoff 250ms for the payment client."),
        AssistantMessage("The payment client retries 5 times; the budget looks fine."),
        UserMessage("Rollback the deploy of the payment service now."),
        AssistantMessage(
            "Running the rollback.",
            (ToolCall("c2", "shell", {"cmd": "kubectl rollout undo deploy/payment"}),),
        ),
        ToolResult(
            "c2",
            "shell",
            "deployment.apps/payment rolled back\n" + "log line of the rollout\n" * 3_000,
        ),
        UserMessage("Which database does the ledger use? Postgres 16 on db-ledger-01."),
    ]
    for i in range(30):  # background chatter
        bodies.append(UserMessage(f"status update {i}: the weather is fine and coffee is ready"))
    return bodies


QUERIES = (
    "3f9a2c1e77b0",
    "OPS-1234 staging key",
    "deploy/nginx/ssl.conf",
    "payment rollback",
    "ssl certificate",
    "retries=5 backoff",
    "db-ledger-01",
    "coffee update 17",
    "kubectl rollout undo",
    "ledger database postgres",
)


@pytest.fixture
async def stores(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[EventStore, EventStore]:
    pytest.importorskip("asyncpg")
    from torpor.store.postgres import PostgresStore

    database: str = request.getfixturevalue("pg_database")
    sqlite = SQLiteStore(str(tmp_path / "log.db"))
    postgres = PostgresStore(await fresh_schema(database))
    await sqlite.open()
    await postgres.open()
    for store in (sqlite, postgres):
        await store.append("c", corpus())
        await store.append("other", [UserMessage("noise about payment and ssl " * 5)])
    yield sqlite, postgres
    await sqlite.close()
    await postgres.close()


async def test_scores_are_comparable_across_backends(
    stores: tuple[EventStore, EventStore],
) -> None:
    sqlite, postgres = stores
    worst = 0.0
    for query in QUERIES:
        lite = await sqlite.search("c", query, k=10)
        pg = await postgres.search("c", query, k=10)
        assert lite and pg, query
        # The same top hits: those at the best score (ties may come in either order).
        best = [{h.position for h in hits if h.score == hits[0].score} for hits in (lite, pg)]
        assert lite[0].score == pg[0].score, (query, lite, pg)
        if len(best[0]) < len(lite):  # k cut no tie short
            assert best[0] == best[1], (query, lite, pg)
        for hits in (lite, pg):
            scores = [h.score for h in hits]
            assert all(0.0 <= s <= 1.0 for s in scores), (query, scores)
            assert scores == sorted(scores, reverse=True), (query, scores)  # monotone
            ranks = [h.rank for h in hits]
            assert ranks == sorted(ranks, reverse=True), (query, ranks)  # backend order kept
        pg_score = {h.position: h.score for h in pg}
        for hit in lite:
            if hit.position in pg_score:
                worst = max(worst, abs(hit.score - pg_score[hit.position]))
        print(  # the figures, with -s
            f"{query!r}: sqlite {[(h.position, round(h.rank, 3), h.score) for h in lite[:3]]} "
            f"postgres {[(h.position, round(h.rank, 4), h.score) for h in pg[:3]]}"
        )
        gated = [{h.position for h in hits if h.score >= THRESHOLD} for hits in (lite, pg)]
        assert gated[0] == gated[1], (query, lite, pg)
    print(f"largest score difference for one hit: {worst}")
    assert worst <= TOLERANCE


async def test_raw_ranks_differ_by_orders_of_magnitude_but_scores_agree(
    stores: tuple[EventStore, EventStore],
) -> None:
    sqlite, postgres = stores
    (lite,) = await sqlite.search("c", "3f9a2c1e77b0", k=1)
    (pg,) = await postgres.search("c", "3f9a2c1e77b0", k=1)
    assert lite.position == pg.position == 5
    assert lite.rank > 10 * pg.rank  # bm25 vs ts_rank: not one scale
    assert lite.score == pg.score == 1.0


def test_coverage_counts_terms_as_the_indexes_match_them() -> None:
    text = "Deploy of src/torpor/store/batch.py failed; see OPS-1234."
    assert coverage(text, "ops-1234") == 1.0
    assert coverage(text, "torpor/store batch.py") == 1.0
    assert coverage(text, "store/torpor") == 0.5  # its words, not in that order
    assert coverage(text, "rollback OPS-1234") == 0.5
    assert coverage(text, "nothing here") == 0.0
    assert coverage(text, "") == 0.0
    assert calibrated([1.0, 0.5, 1.0, 0.25]) == [1.0, 0.5, 0.5, 0.25]
