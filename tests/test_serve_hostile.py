"""Hostile input over real HTTP on loopback (issue 21, items 5 to 7): bodies that are not
UTF-8 or nest without end, ids that cannot round-trip, cursors past any position, user
names that own each other's conversations, and keyed retries that join a running turn."""

from __future__ import annotations

import logging

import anyio
import pytest
from serve_support import TOKEN, served

from torpor import AgentConfig, ExternalTool, Runtime, ScriptedModel
from torpor.llm.scripted import Call, Text, Wait
from torpor.serve import bearer_tokens
from torpor.serve.client import Client

DEPTH = 100_000
HOSTILE_BODIES = {
    "invalid UTF-8 in a string": b'{"text": "caf\xe9"}',
    "a UTF-16 surrogate encoded as UTF-8": b'{"text": "\xed\xa0\x80"}',
    "arrays nested 100k deep": b"[" * DEPTH + b"]" * DEPTH,
    "objects nested 100k deep": b'{"a":' * DEPTH + b"1" + b"}" * DEPTH,
    "arrays and objects nested 100k deep": b'[{"a":' * (DEPTH // 2) + b"1" + b"}]" * (DEPTH // 2),
}


async def raw(client: Client, method: str, target: str, body: bytes | None = None,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with the target and body sent exactly as given."""
    conn = client.connection()
    try:
        response = await conn.request(method, target, body=body, headers={
            "Authorization": f"Bearer {TOKEN}", "Accept": "application/json",
            "Connection": "close", **(headers or {})})
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return response.status, response.headers, b""  # a stream: its status says enough
        return response.status, response.headers, await response.read()
    finally:
        await conn.close()


@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
async def test_a_hostile_body_is_400_malformed_body_without_an_error_record(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with Runtime("sqlite://") as rt, served(rt) as (_, client, _app):
        for path in ("/v1/conversations/c/messages", "/v1/conversations/c/calls/x"):
            status, headers, body = await raw(client, "POST", path, HOSTILE_BODIES[name])
            assert status == 400, (name, path, body[:200])
            assert headers["content-type"] == "application/problem+json"
            assert b'"error":"MalformedBody"' in body, body[:200]
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [r.getMessage()[:200] for r in loud]


async def test_ids_whose_escapes_are_not_utf8_are_refused_not_merged() -> None:
    """%FF and %FE both decode to U+FFFD: refused, so they never name one conversation;
    a real U+FFFD (%EF%BF%BD) is an id like any other."""
    async with Runtime("sqlite://") as rt, served(rt) as (_, client, _app):
        for target in ("/v1/conversations/%FF/messages", "/v1/conversations/%FE/messages",
                       "/v1/conversations/ok%C3/messages", "/v1/conversations/c/calls/%FF"):
            status, _, body = await raw(client, "POST", target, b'{"text": "hi"}')
            assert status == 422, (target, body)
            assert b'"error":"InvalidInput"' in body
        for target in ("/v1/conversations/%FF/history", "/v1/conversations/%FE/stream"):
            status, _, body = await raw(client, "GET", target)
            assert status == 422, (target, body)
        assert await rt.store.head("\ufffd") is None  # nothing was written
        status, _, body = await raw(client, "POST", "/v1/conversations/%EF%BF%BD/messages",
                                    b'{"text": "hi"}')
        assert status == 202, body
        assert await rt.store.head("\ufffd") is not None


async def test_a_cursor_past_every_position_is_422_before_the_stream() -> None:
    async with Runtime("sqlite://") as rt, served(rt) as (_, client, _app):
        await client.send("c", "hi")
        for cursor in (str(2**32), str(2**40), f"{2**62}.3"):
            for headers, target in (({"Last-Event-ID": cursor}, "/v1/conversations/c/stream"),
                                    ({}, f"/v1/conversations/c/stream?after={cursor}")):
                status, _, body = await raw(client, "GET", target, headers=headers)
                assert status == 422, (cursor, target, body)
                assert b'"error":"InvalidInput"' in body
        # the largest position a log can reach is still a cursor
        status, headers, _ = await raw(client, "GET", "/v1/conversations/c/stream",
                                       headers={"Last-Event-ID": str(2**32 - 1)})
        assert status == 200 and headers["content-type"].startswith("text/event-stream")


async def test_query_integers_are_ascii_digits_only() -> None:
    """Python's int() takes " 1", "1_0" (10) and other scripts' digits (Arabic-Indic one):
    ``?turn=1_0`` must not be turn 10, nor ``?limit=%D9%A1`` a limit of 1."""
    async with Runtime("sqlite://", model=ScriptedModel(["a"] * 12)) as rt, \
            served(rt) as (_, client, _app):
        for _ in range(10):
            await (await rt.send("c", "hi")).result()
        for query in ("turn=1_0", "turn=%201", "turn=%D9%A1", "turn=1.0", "turn=0x1",
                      "turn=%2B1", "turn=" + "9" * 21):
            status, _, body = await raw(client, "GET", f"/v1/conversations/c/stream?{query}")
            assert status == 422, (query, body)
            assert b'"error":"InvalidInput"' in body and b"must be an integer" in body
        for query in ("limit=%D9%A1", "before=%201", "limit=1_0"):
            status, _, body = await raw(client, "GET", f"/v1/conversations/c/history?{query}")
            assert status == 422, (query, body)
        for query, expected in (("turn=10", 200), ("turn=-1", 404), ("turn=11", 404)):
            status, _, body = await raw(client, "GET", f"/v1/conversations/c/stream?{query}")
            assert status == expected, (query, body)


def test_bearer_tokens_refuses_a_user_name_that_extends_another() -> None:
    """README: a table where one user name is another followed by the separator is refused
    (``alice`` would own every ``alice:team:…`` conversation)."""
    with pytest.raises(ValueError, match="'alice' would own the conversations of user "
                                         "'alice:team'"):
        bearer_tokens({"t1": "alice", "t2": "alice:team"})
    with pytest.raises(ValueError, match="'alice' would own"):
        bearer_tokens({"t1": "alice:team:x", "t2": "bob", "t3": "alice"})
    with pytest.raises(ValueError, match="'org/a' would own"):
        bearer_tokens({"t1": "org/a", "t2": "org/a/b"}, separator="/")
    with pytest.raises(ValueError, match="separator"):
        bearer_tokens({"t1": "alice"}, separator="")
    # names that merely share a start, or contain the separator alone, are fine
    bearer_tokens({"t1": "alice", "t2": "alicia", "t3": "alice-team", "t4": "bob:team"})


async def test_a_user_named_with_the_separator_owns_only_its_own_conversations() -> None:
    authorize = bearer_tokens({"tok-t": "alice:team", "tok-b": "bob"})
    async with Runtime("sqlite://") as rt, served(rt, authorize=authorize) as (url, _, _app):
        team, bob = Client(url, "tok-t"), Client(url, "tok-b")
        await team.send("alice:team:1", "ours")
        await team.send("alice:team", "ours too")
        for cid in ("alice", "alice:1", "alice:teammate"):
            status = (await team.open("GET", f"/v1/conversations/{cid}/history"))[1].status
            assert status == 403, cid
        status = (await bob.open("GET", "/v1/conversations/alice:team:1/history"))[1].status
        assert status == 403


async def test_a_keyed_retry_that_joins_a_running_turn_is_replayed() -> None:
    gate = anyio.Event()
    model = ScriptedModel([[Wait(gate), Text("done")]])
    async with Runtime("sqlite://", model=model) as rt, served(rt) as (_, client, _app):
        first = await client.send("c", "once", key="k1")
        again = await client.send("c", "once", key="k1")  # the turn is still running
        assert first["replayed"] is False
        assert again["replayed"] is True
        assert again["position"] == first["position"] and again["turn"] == first["turn"]
        running = await rt.send("c", "once", key="k1")  # the same turn, joined in-process
        gate.set()
        with anyio.fail_after(10):
            await running.result()
        after = await client.send("c", "once", key="k1")  # ended: replayed from the log
        assert after["replayed"] is True and after["position"] == first["position"]


async def test_a_keyed_answer_retried_while_its_continuation_runs_is_replayed() -> None:
    gate = anyio.Event()
    approve = ExternalTool("approve", "Ask a person.", {"type": "object", "properties": {}})
    model = ScriptedModel([[Call("approve", {}, id="call-1")], [Wait(gate), Text("done")]])
    async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[approve])) as rt, \
            served(rt) as (_, client, _app):
        turn = await rt.send("s", "deploy?")
        await turn.result()  # suspended on call-1
        first = await client.resolve("s", "call-1", "yes", key="r1")
        again = await client.resolve("s", "call-1", "yes", key="r1")  # continuation runs
        assert first == {"resolved": "call-1", "continuation": True, "replayed": False}
        assert again == {"resolved": "call-1", "continuation": True, "replayed": True}
        gate.set()
