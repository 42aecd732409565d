"""``resolve`` with an idempotency key (issue 20, item 9), on SQLite and PostgreSQL.

A retried resolve after the first one committed but its reply was lost (a node died) got
``UnknownCall``. With the same ``key`` as the first, as for ``send``, it gets that answer's
outcome back (None, or the continuation); the same key with another answer is
``IdempotencyConflict``; nothing is ever logged twice.
"""

from __future__ import annotations

import anyio
import pytest
from serve_support import kinds, served
from store_backends import Backend

from torpor import (
    AgentConfig,
    ExternalTool,
    IdempotencyConflict,
    Runtime,
    ScriptedModel,
    Suspended,
    ToolResult,
    UnknownCall,
)
from torpor.llm.scripted import Call, Text, Wait
from torpor.serve.client import HTTPStatusError

APPROVE = ExternalTool("approve", "Ask a person.", {"type": "object", "properties": {}})
AGENT = AgentConfig(tools=[APPROVE])


def url_of(backend: Backend) -> str:
    return f"sqlite:///{backend.location}" if backend.name == "sqlite" else str(backend.location)


async def answers(rt: Runtime, conversation_id: str) -> list[ToolResult]:
    newest_first = await rt.history(conversation_id, limit=100)
    return [e.body for e in reversed(newest_first) if isinstance(e.body, ToolResult)]


async def suspend(rt: Runtime, conversation_id: str) -> Suspended:
    outcome = await (await rt.send(conversation_id, "deploy")).result()
    assert isinstance(outcome, Suspended)
    return outcome


async def test_a_retry_with_the_key_gets_the_first_outcome_even_after_a_restart(
    backend: Backend,
) -> None:
    model = ScriptedModel([[Text("asking"), Call("approve", id="c1")], [Text("deployed")]],
                          loop=True)
    async with Runtime(url_of(backend), model=model, agent=AGENT) as rt:
        await suspend(rt, "c")
        first = await rt.resolve("c", "c1", "approved", key="r1")
        assert first is not None and (await first.result()).text == "deployed"
        again = await rt.resolve("c", "c1", "approved", key="r1")
        assert again is not None and again.replayed and again.continuation
        assert again.number == first.number and (await again.result()).text == "deployed"
        with pytest.raises(UnknownCall):  # without the key: as before
            await rt.resolve("c", "c1", "approved")
        with pytest.raises(UnknownCall):  # a key nobody used for it
            await rt.resolve("c", "c1", "approved", key="r2")
        with pytest.raises(IdempotencyConflict):  # the key, for another answer
            await rt.resolve("c", "c1", "rejected", key="r1")
        with pytest.raises(IdempotencyConflict):
            await rt.resolve("c", "c1", "approved", is_error=True, key="r1")
        with pytest.raises(IdempotencyConflict):
            await rt.resolve("c", "c2", "approved", key="r1")
        assert [a.content for a in await answers(rt, "c")] == ["approved"]
    # The reply was lost and the process is gone: the retry reaches a new runtime.
    async with Runtime(url_of(backend), model=model, agent=AGENT) as rt2:
        again = await rt2.resolve("c", "c1", "approved", key="r1")
        assert again is not None and again.replayed
        assert (await again.result()).text == "deployed"
        assert [a.content for a in await answers(rt2, "c")] == ["approved"]


async def test_each_answer_of_a_suspension_replays_its_own_outcome(backend: Backend) -> None:
    model = ScriptedModel([[Call("approve", id="c1"), Call("approve", id="c2")],
                           [Text("both done")]])
    async with Runtime(url_of(backend), model=model, agent=AGENT) as rt:
        await suspend(rt, "c")
        assert await rt.resolve("c", "c1", "yes", key="k1") is None  # c2 still unanswered
        assert await rt.resolve("c", "c1", "yes", key="k1") is None  # still waiting then
        last = await rt.resolve("c", "c2", "yes too", key="k2")
        assert last is not None and (await last.result()).text == "both done"
        assert await rt.resolve("c", "c1", "yes", key="k1") is None  # what k1 got
        again = await rt.resolve("c", "c2", "yes too", key="k2")
        assert again is not None and (await again.result()).text == "both done"
        assert [a.content for a in await answers(rt, "c")] == ["yes", "yes too"]


async def test_a_retry_while_the_continuation_runs_gets_that_turn(backend: Backend) -> None:
    gate = anyio.Event()
    model = ScriptedModel([[Call("approve", id="c1")], [Wait(gate), Text("finally")]])
    async with Runtime(url_of(backend), model=model, agent=AGENT) as rt:
        await suspend(rt, "c")
        first = await rt.resolve("c", "c1", "go", key="r1")
        again = await rt.resolve("c", "c1", "go", key="r1")
        assert again is first  # the live continuation, not a copy
        gate.set()
        assert (await first.result()).text == "finally"


async def test_a_key_used_for_a_message_is_refused_for_an_answer(backend: Backend) -> None:
    model = ScriptedModel([[Call("approve", id="c1")], [Text("ok")]])
    async with Runtime(url_of(backend), model=model, agent=AGENT) as rt:
        outcome = await (await rt.send("c", "deploy", key="shared")).result()
        assert isinstance(outcome, Suspended)
        with pytest.raises(IdempotencyConflict):
            await rt.resolve("c", "c1", "approved", key="shared")
        assert await answers(rt, "c") == []  # nothing written: still waiting for c1
        resumed = await rt.resolve("c", "c1", "approved", key="own")
        assert resumed is not None and (await resumed.result()).text == "ok"


async def test_over_http_a_retried_answer_gets_the_same_answer() -> None:
    model = ScriptedModel([[Call("approve", id="c1")], [Text("approved: shipping")]],
                          loop=True)
    async with Runtime("sqlite://", model=model, agent=AGENT) as rt, \
            served(rt) as (_url, client, _app):
        await suspend(rt, "c")
        first = await client.resolve("c", "c1", "yes", key="r1")
        again = await client.resolve("c", "c1", "yes", key="r1")
        assert first == {"resolved": "c1", "continuation": True, "replayed": False}
        assert again == {"resolved": "c1", "continuation": True, "replayed": True}
        with pytest.raises(HTTPStatusError) as refused:  # no key: as before
            await client.resolve("c", "c1", "yes")
        assert refused.value.status == 404 and refused.value.problem["error"] == "UnknownCall"
        with pytest.raises(HTTPStatusError) as conflict:
            await client.resolve("c", "c1", "no", key="r1")
        assert conflict.value.status == 409
        assert conflict.value.problem["error"] == "IdempotencyConflict"
        # Streamed, the retry shows what the first answer's stream showed: the answer, then
        # the continuation to its end.
        conn, response = await client.open(
            "POST", "/v1/conversations/c/calls/c1", json_body={"result": "yes"},
            headers={"Idempotency-Key": "r1", "Accept": "text/event-stream"},
            conn=client.connection())
        events = [e async for e in response.events()]
        await conn.close()
        assert response.status == 200
        assert kinds(events) == ["tool_result", "resolved", "assistant"]
        assert events[-1].json()["body"]["text"] == "approved: shipping"
        assert [a.content for a in await answers(rt, "c")] == ["yes"]
