"""Conversations as owned data over real HTTP: list, delete and export (serve.conversations).

Two users with ``bearer_tokens``: each lists only their own conversations (paged
by cursor), may delete only their own (another's is 403 and nothing is deleted),
and an export streams JSON lines equal to the history, artifacts inline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from serve_support import served

from torpor import Runtime
from torpor.events import AssistantMessage, ToolCall, ToolResult, UserMessage
from torpor.serve import bearer_tokens
from torpor.serve.client import Client, HTTPStatusError


def _users() -> Any:
    return bearer_tokens({"tok-a": "alice", "tok-b": "bob"})


async def _listed(client: Client, query: str = "", limit: int = 2) -> list[dict[str, Any]]:
    """Every conversation the client lists, page by page (asserting pages are bounded)."""
    seen: list[dict[str, Any]] = []
    after = ""
    for _ in range(50):
        page = await client.call("GET", f"/v1/conversations?limit={limit}{query}{after}")
        assert len(page["conversations"]) <= limit
        seen += page["conversations"]
        if page["next"] is None:
            return seen
        after = f"&after={page['next']}"
    raise AssertionError("listing never ended")


async def test_each_user_lists_only_their_own_paged_by_cursor(tmp_path: Path) -> None:
    async with Runtime(f"sqlite:///{tmp_path / 'rt.db'}") as rt, served(
        rt, authorize=_users()
    ) as (url, _client, _app):
        alice, bob = Client(url, "tok-a"), Client(url, "tok-b")
        for name in ("alice", "alice:1", "alice:2", "alice:3"):
            await alice.send(name, f"hello from {name}")
        for name in ("bob:1", "bob:2"):
            await bob.send(name, f"hello from {name}")
        # Another user's prefix that alice's name starts: in her range, not hers.
        await (await rt.send("alice2", "not alice's")).result()
        await (await rt.send("alice2:x", "not alice's either")).result()

        mine = await _listed(alice)
        assert sorted(c["id"] for c in mine) == ["alice", "alice:1", "alice:2", "alice:3"]
        assert [c["id"] for c in mine] == [i.id for i in await rt.conversations(prefix="alice")
                                           if i.id in {"alice", "alice:1", "alice:2", "alice:3"}]
        first = next(c for c in mine if c["id"] == "alice:1")
        assert set(first) == {"id", "created_at", "last_activity", "events", "title"}
        assert first["title"] == "hello from alice:1" and first["events"] >= 1
        assert sorted(c["id"] for c in await _listed(bob, limit=1)) == ["bob:1", "bob:2"]
        # A narrower prefix of one's own is fine; another's is refused.
        assert [c["id"] for c in await _listed(alice, "&prefix=alice:2")] == ["alice:2"]
        with pytest.raises(HTTPStatusError) as info:
            await bob.call("GET", "/v1/conversations?prefix=alice")
        assert info.value.status == 403
        with pytest.raises(HTTPStatusError) as info:
            await Client(url, "nobody").call("GET", "/v1/conversations")
        assert info.value.status == 401
        with pytest.raises(HTTPStatusError) as info:
            await alice.call("GET", "/v1/conversations?after=not-a-cursor")
        assert info.value.status == 422


async def test_delete_is_the_owners_only(tmp_path: Path) -> None:
    async with Runtime(f"sqlite:///{tmp_path / 'rt.db'}") as rt, served(
        rt, authorize=_users()
    ) as (url, _client, _app):
        alice, bob = Client(url, "tok-a"), Client(url, "tok-b")
        await alice.send("alice:1", "keep this safe")
        await alice.send("alice:2", "another")
        with pytest.raises(HTTPStatusError) as info:
            await bob.call("DELETE", "/v1/conversations/alice:1", expect=(204,))
        assert info.value.status == 403
        assert await rt.store.head("alice:1") is not None  # nothing deleted
        # One that does not exist answers the same: a refusal says nothing about existence.
        for method, path in (("DELETE", "/v1/conversations/alice:none"),
                             ("GET", "/v1/conversations/alice:none/export"),
                             ("GET", "/v1/conversations/alice:1/export")):
            with pytest.raises(HTTPStatusError) as info:
                await bob.call(method, path, expect=(200, 204))
            assert (info.value.status, info.value.problem["error"]) == (403, "Forbidden"), path
        assert await rt.store.deletions() == []
        assert (await alice.call("GET", "/v1/conversations/alice:1/history"))["events"]

        assert await alice.call("DELETE", "/v1/conversations/alice:1", expect=(204,)) is None
        with pytest.raises(HTTPStatusError) as info:
            await alice.call("DELETE", "/v1/conversations/alice:1", expect=(204,))
        assert (info.value.status, info.value.problem["error"]) == (404, "UnknownConversation")
        with pytest.raises(HTTPStatusError) as info:
            await alice.call("GET", "/v1/conversations/alice:1/history")
        assert info.value.status == 404
        assert [c["id"] for c in await _listed(alice)] == ["alice:2"]
        audit = await rt.store.deletions()
        assert [(d.conversations, d.by) for d in audit] == [(("alice:1",), "delete")]


async def test_export_streams_json_lines_equal_to_the_history(tmp_path: Path) -> None:
    big = "".join(f"line {i} of a long tool result\n" for i in range(10000))  # an artifact
    async with Runtime(f"sqlite:///{tmp_path / 'rt.db'}") as rt, served(
        rt, authorize=_users()
    ) as (url, _client, _app):
        alice, bob = Client(url, "tok-a"), Client(url, "tok-b")
        await alice.send("alice:x", "first")
        assert await rt.set_metadata("alice:x", {"plan": "internal-tier-7"})  # the host's
        # A tool result over the artifact threshold, logged as a turn with a tool logs it.
        call = ToolCall("call-1", "fetch", {"url": "x"})
        await rt.store.append("alice:x", [UserMessage("fetch it")])
        turn = (await rt.history("alice:x", limit=1))[0].turn
        await rt.store.append("alice:x", [AssistantMessage("", (call,))], turn=turn)
        await rt.store.append("alice:x", [ToolResult("call-1", "fetch", big)], turn=turn)
        await rt.store.append("alice:x", [AssistantMessage("fetched")], turn=turn)
        connection, response = await alice.open("GET", "/v1/conversations/alice:x/export")
        try:
            assert response.status == 200
            assert response.headers["content-type"].startswith("application/x-ndjson")
            raw = await response.read()
        finally:
            await connection.close()
        assert raw.endswith(b"\n")
        records = [json.loads(line) for line in raw.decode().splitlines()]
        head, rest = records[0], records[1:]
        assert head["type"] == "conversation" and head["id"] == "alice:x"
        # Neither the host's metadata nor a message's (the server's word about the sender).
        assert "metadata" not in head and b"internal-tier-7" not in raw
        assert b'"user":"alice"' not in raw.replace(b" ", b"")
        history = await alice.call("GET", "/v1/conversations/alice:x/history?limit=1000")
        events = [{k: v for k, v in r.items() if k != "type"} for r in rest
                  if r["type"] == "event"]
        assert events == list(reversed(history["events"]))
        assert head["events"] == len(events)
        clipped = [e for e in events if e["body"].get("artifact")]
        assert clipped, "the long tool result was clipped to an artifact"
        pieces = [r for r in rest if r["type"] == "artifact"]
        assert {p["position"] for p in pieces} == {e["position"] for e in clipped}
        assert len(pieces) >= 2 and [p["last"] for p in pieces][-1] is True  # in chunks
        full = "".join(p["text"] for p in pieces if p["position"] == clipped[0]["position"])
        assert full == big
        assert len(clipped[0]["body"]["content"]) < len(big)  # the event holds a preview

        with pytest.raises(HTTPStatusError) as info:
            await bob.call("GET", "/v1/conversations/alice:x/export")
        assert info.value.status == 403
        with pytest.raises(HTTPStatusError) as info:
            await alice.call("GET", "/v1/conversations/alice:none/export")
        assert (info.value.status, info.value.problem["error"]) == (404, "UnknownConversation")
