"""Numbers and names written differently match (issue 25, items 5 and 6).

A contract on every backend: ``20000-user`` finds "The 20,000-user load test" (and
"20 000"), ``zoe`` scores 1.0 against "Zoë", ``soren`` finds "Søren", ``lukasz``
"Łukasz"; a delete or redaction still removes the normalised index entries (on
SQLite, exactly: the vocabulary of the contentless index holds none of their terms);
a database indexed before the normalised form is migrated to it.
"""

from __future__ import annotations

import sqlite3

import pytest
from store_backends import AnyStore, Backend

from torpor.events import ToolResult, UserMessage
from torpor.store.normalise import index_form, query_form

NAMES = "Zoë met Søren, Łukasz and the Żółć team"
LOAD = "The 20,000-user load test passed"
SPACED = "a 20 000 user soak ran too"
OTHER = "keep this unrelated note about coffee"


async def _positions(store: AnyStore, query: str) -> list[int]:
    return [h.position for h in await store.search("c", query)]


async def test_grouped_numbers_match_however_written(store: AnyStore) -> None:
    await store.append("c", [UserMessage(LOAD), UserMessage(SPACED), UserMessage(OTHER)])
    hits = await store.search("c", "20000-user load test")
    assert hits[0].position == 0 and hits[0].score == 1.0
    assert "20,000-user" in hits[0].snippet  # the stored text is unchanged
    assert set(await _positions(store, "20000")) == {0, 1}
    assert set(await _positions(store, "20,000")) == {0, 1}
    merged = await store.search("c", "20 000-user")  # one term once merged
    assert {h.position for h in merged} == {0, 1} and all(h.score == 1.0 for h in merged)
    assert 0 in await _positions(store, "000")  # a part of a merged number still matches


async def test_dots_are_not_grouping(store: AnyStore) -> None:
    await store.append("c", [UserMessage("pi is 3.14 and torpor 1.2.3 ships 20.000 units")])
    assert await _positions(store, "314") == []
    assert await _positions(store, "20000") == []
    assert await _positions(store, "1.2.3") == [0]


async def test_diacritics_fold_on_both_sides_and_score_as_a_match(store: AnyStore) -> None:
    await store.append("c", [UserMessage(OTHER), UserMessage(NAMES)])
    for query in ("zoe", "soren", "lukasz", "zolc", "Zoë", "SØREN", "ŁUKASZ"):
        hits = await store.search("c", query)
        assert [h.position for h in hits] == [1], query
        assert hits[0].score == 1.0, query
    await store.append("c", [UserMessage("Lukasz wrote the plain spelling")])
    assert set(await _positions(store, "Łukasz")) == {1, 2}


async def test_a_tool_result_is_normalised_too(store: AnyStore) -> None:
    await store.append("c", [ToolResult("t1", "lookup", '{"owner": "Søren", "seats": 12,500}')])
    assert await _positions(store, "soren 12500") == [0]
    assert (await store.search("c", "soren 12500"))[0].score == 1.0


def _vocabulary(path: str) -> dict[str, int]:
    """Term -> documents holding it, read from the contentless index itself."""
    raw = sqlite3.connect(path)
    try:
        raw.execute("CREATE VIRTUAL TABLE temp.vocab USING fts5vocab(main, events_fts, row)")
        return {term: docs for term, docs in raw.execute("SELECT term, doc FROM temp.vocab")}
    finally:
        raw.close()


@pytest.mark.parametrize("erase", ["redact", "delete"])
async def test_erasure_removes_the_normalised_entries(backend: Backend, erase: str) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage(NAMES), UserMessage(LOAD)])
        await store.append("keep", [UserMessage(OTHER)])
        # Searched: the backlog is indexed, the entries are in the index proper.
        assert set(await _positions(store, "soren 20000")) == {0, 1}
        if erase == "redact":
            assert await store.redact("c", 0) is True
            assert await store.redact("c", 1) is True
        else:
            assert await store.delete("c") is not None
        for query in ("soren", "lukasz", "zoe", "20000", "20000-user"):
            assert await store.search("c", query) == [], query
        assert [h.position for h in await store.search("keep", "coffee")] == [0]
    if backend.postgres:
        rows = await backend.sql(
            "SELECT count(*) FROM events_fts WHERE document @@ to_tsquery('simple', ?)",
            "soren | lukasz | zoe | 20000",
        )
        assert rows == [(0,)]
    else:
        assert backend.location is not None
        vocabulary = _vocabulary(backend.location)
        gone = {"soren", "lukasz", "zoe", "zolc", "20000", "load", "met"}
        assert not gone & set(vocabulary), vocabulary
        assert vocabulary["coffee"] == 1


async def _as_before_normalising(backend: Backend) -> None:
    """Put the index back in the form of the previous schema version (text as written)."""
    texts = {0: NAMES, 1: LOAD}
    if backend.postgres:
        for position, text in texts.items():
            await backend.sql(
                "UPDATE events_fts SET document = to_tsvector('simple', ?) WHERE position = ?",
                text, position,
            )
        await backend.sql("DELETE FROM schema_version WHERE version >= 10")  # and later ones
        return
    assert backend.location is not None
    raw = sqlite3.connect(backend.location)
    try:
        key = raw.execute("SELECT key FROM conversations WHERE external_id = 'c'").fetchone()[0]
        for position, text in texts.items():
            rowid = (key << 32) | position
            raw.execute(
                "INSERT INTO events_fts (events_fts, rowid, text) VALUES ('delete', ?, ?)",
                (rowid, index_form(text)),
            )
            if position == 0:
                raw.execute("INSERT INTO events_fts (rowid, text) VALUES (?, ?)", (rowid, text))
            else:  # this one waits in the search backlog, as written
                raw.execute("INSERT INTO fts_backlog (rowid, text) VALUES (?, ?)", (rowid, text))
        raw.execute("PRAGMA user_version = 8")
        raw.commit()
    finally:
        raw.close()


async def test_an_older_index_is_migrated_to_the_normalised_form(backend: Backend) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage(NAMES), UserMessage(LOAD)])
        assert len(await store.search("c", "soren 20000")) == 2
    await _as_before_normalising(backend)
    if not backend.postgres:
        assert backend.location is not None
        assert "soren" not in _vocabulary(backend.location)  # (the check below can fail)
    async with backend.open() as store:
        assert await _positions(store, "soren") == [0]
        assert await _positions(store, "20000-user") == [1]
        assert await store.redact("c", 0) is True
        assert await store.redact("c", 1) is True
        assert await store.search("c", "soren 20000 load") == []
    if not backend.postgres:
        assert backend.location is not None
        vocabulary = _vocabulary(backend.location)
        assert not {"soren", "søren", "20000", "20", "000", "load"} & set(vocabulary)


def test_the_forms() -> None:
    assert index_form("Żółć straße ǿ e\u0301") == "Zolc strasse o e"
    assert index_form("x [12,345,678]") == "x [12345678]\n12 345 678"
    assert index_form("5 12 345 and 1,234,5") == "5 12 345 and 1,234,5"  # columns, a list
    assert index_form("20\u202f000 and 20\u00a0000") == "20000 and 20000\n20 000"
    assert index_form("한국어 नमस्ते") == "한국어 नमस्ते"  # other scripts' marks are kept
    assert query_form("20 000-user Søren") == "20000-user Soren"
    plain = "plain ascii text 2024 and 3.14"
    assert index_form(plain) is plain and query_form(plain) is plain
