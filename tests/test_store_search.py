"""Full-text search over the whole log, and artifacts for large tool results.

A contract: every test runs on each backend (see store_backends.py).
"""

from __future__ import annotations

import asyncio

import pytest
from store_backends import AnyStore, Backend

from torpor.events import AssistantMessage, ToolCall, ToolResult, UserMessage
from torpor.store.prepare import PREVIEW_BYTES

FILLER = "the build ran and the tests passed without any surprises today"


async def test_search_finds_a_hash_and_a_path_appended_long_ago(
    store: AnyStore,
) -> None:
    await store.append("c", [UserMessage("we are at commit 3f9a2c1e77b0 now")])
    await store.append(
        "c",
        [AssistantMessage("", (ToolCall("t1", "open", {"path": "src/torpor/store/batch.py"}),))],
    )
    await asyncio.gather(*(store.append("c", [UserMessage(f"{FILLER} {i}")]) for i in range(300)))
    await store.append("other", [UserMessage("3f9a2c1e77b0 is also here")])

    hits = await store.search("c", "3f9a2c1e77b0")
    assert [h.position for h in hits] == [0]  # only this conversation
    assert "3f9a2c1e77b0" in hits[0].snippet and hits[0].kind == "user"
    for query in ("src/torpor/store/batch.py", "store/batch.py", "batch.py", "torpor/store"):
        path_hits = await store.search("c", query)
        assert [h.position for h in path_hits] == [1], query
        assert "src/torpor/store/batch.py" in path_hits[0].snippet


async def test_scores_rank_better_matches_higher_and_k_limits(store: AnyStore) -> None:
    await store.append(
        "c",
        [
            UserMessage("deploy the service"),
            UserMessage("rollback the deploy of the payment service now"),
            UserMessage("unrelated words entirely"),
            UserMessage("payment"),
        ],
    )
    hits = await store.search("c", "payment rollback", k=10)
    assert hits[0].position == 1  # matches both terms
    assert {h.position for h in hits} == {1, 3}
    assert hits[0].score > hits[1].score > 0
    assert len(await store.search("c", "deploy service payment", k=2)) == 2


@pytest.mark.parametrize(
    "query",
    ['"', "AND", "a OR", "NEAR(", "*", "col:umn", "-x", "(", "^start", "it's", 'a"b', "\\",
     "a | b", "!x", "&", "'"],  # fmt: skip - FTS5 syntax, then tsquery syntax
)
async def test_queries_with_fts_syntax_characters_do_not_raise(
    store: AnyStore, query: str
) -> None:
    await store.append("c", [UserMessage("AND it's a column: value (x) -x ^start !x a | b")])
    hits = await store.search("c", query)
    assert all(h.position == 0 for h in hits)
    assert await store.search("c", "   ") == []


async def test_large_tool_results_are_clipped_into_artifacts(any_backend: Backend) -> None:
    tail = "needle-b7e4 is only at the very end"
    content = "x " * 20_000 + tail
    async with any_backend.open(artifact_threshold=16 * 1024) as store:
        [event] = await store.append_events("c", [ToolResult("call-1", "cat", content)])
        body = event.body
        assert isinstance(body, ToolResult)
        assert body.artifact is not None and body.full_size == len(content.encode())
        assert body.content.startswith("x " * 100)
        assert len(body.content.encode()) < PREVIEW_BYTES + 200
        assert tail not in body.content and body.artifact in body.content
        assert event.tokens < 400  # counted on the clipped body
        [stored] = await store.read_since("c", 0)
        assert stored.body == body
        assert (await store.get_artifact(body.artifact)).decode() == content
        # search indexes the full text, beyond the preview
        hits = await store.search("c", "needle-b7e4")
        assert [h.position for h in hits] == [0]
        assert "needle-b7e4" in hits[0].snippet
        # small results are kept whole
        [small] = await store.append_events("c", [ToolResult("call-2", "cat", "short")])
        assert isinstance(small.body, ToolResult) and small.body.artifact is None
        # a text longer than one index chunk is searchable to its end
        long = " ".join(f"w{i}" for i in range(40_000)) + " last-9c1d"
        await store.append("c", [ToolResult("call-3", "cat", long)])
        assert [h.position for h in await store.search("c", "last-9c1d")] == [2]


async def test_put_and_get_artifact(store: AnyStore) -> None:
    data = bytes(range(256)) * 100
    await store.append("c", [UserMessage("x")])  # only an append creates a conversation
    artifact_id = await store.put_artifact("c", data)
    assert await store.get_artifact(artifact_id) == data
    with pytest.raises(KeyError):
        await store.get_artifact("art-missing")
