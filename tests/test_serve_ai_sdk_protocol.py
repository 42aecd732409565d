"""``/v1/ai-sdk/chat`` over a real loopback socket, read as raw UI message chunks: access
control, refusals, a postponed message's stream, approvals answered one at a time, a
retried request, and the resume route's 204s. (The SDK's own client: test_serve_ai_sdk.)"""

from __future__ import annotations

from typing import Any

import anyio
from serve_support import served

from torpor import AgentConfig, ExternalTool, Runtime, ScriptedModel
from torpor.events import Event, UserMessage
from torpor.llm.scripted import Call, Signal, Text, Wait
from torpor.serve import bearer_tokens
from torpor.serve.client import Client

CHAT = "/v1/ai-sdk/chat"
APPROVE = ExternalTool("approve", "Ask a person.", {"type": "object", "properties": {}})


def user(text: str, ui_id: str = "u1") -> dict[str, Any]:
    return {"id": ui_id, "role": "user", "parts": [{"type": "text", "text": text}]}


def answered(call_ids: list[tuple[str, bool]], ui_id: str = "turn-1") -> dict[str, Any]:
    return {"id": ui_id, "role": "assistant", "parts": [
        {"type": "step-start"},
        *({"type": "tool-approve", "toolCallId": call_id, "state": "approval-responded",
           "input": {}, "approval": {"id": call_id, "approved": approved}}
          for call_id, approved in call_ids),
    ]}


async def chat(client: Client, cid: str, *messages: dict[str, Any],
               **extra: Any) -> tuple[int, dict[str, str], list[Any]]:
    """POST like DefaultChatTransport; the status, headers and chunks ([DONE] as a str)."""
    body = {"id": cid, "messages": list(messages), "trigger": "submit-message",
            "messageId": None, **extra}
    conn, response = await client.open("POST", CHAT, json_body=body,
                                       headers={"Content-Type": "application/json"})
    try:
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            return response.status, response.headers, [await response.json()]
        chunks = [e.data if e.data == "[DONE]" else e.json() async for e in response.events()]
        return response.status, response.headers, chunks
    finally:
        await conn.close()


def text(chunks: list[Any]) -> str:
    return "".join(c["delta"] for c in chunks if isinstance(c, dict) and c["type"] == "text-delta")


def types(chunks: list[Any]) -> list[str]:
    return [c if isinstance(c, str) else c["type"] for c in chunks]


async def test_access_goes_through_authorize_for_the_post_and_the_resume() -> None:
    authorize = bearer_tokens({"tok-a": "alice", "tok-b": "bob"})
    async with Runtime("sqlite://") as rt, served(rt, authorize=authorize) as (url, _, _app):
        alice, bob, nobody = Client(url, "tok-a"), Client(url, "tok-b"), Client(url, "")
        status, headers, chunks = await chat(alice, "alice:1", user("hi"))
        assert status == 200 and headers["x-vercel-ai-ui-message-stream"] == "v1"
        assert text(chunks) == "echo: hi" and chunks[-1] == "[DONE]"
        assert (await chat(bob, "alice:1", user("mine now")))[0] == 403
        assert (await chat(nobody, "alice:1", user("anyone?")))[0] == 401
        for client, status in ((bob, 403), (nobody, 401), (alice, 204)):
            conn, response = await client.open("GET", f"{CHAT}/alice:1/stream")
            await response.read()
            await conn.close()
            assert response.status == status
        assert [e.body.text for e in await rt.history("alice:1")][::-1] == ["hi", "echo: hi"]


async def test_refusals_are_problems_before_the_stream() -> None:
    async with Runtime("sqlite://") as rt, served(rt) as (_, client, _app):
        for extra, messages, error in (
            ({"trigger": "regenerate-message"}, [user("again")], "InvalidInput"),
            ({}, [], "InvalidInput"),
            ({}, [{"id": "x", "role": "user", "parts": [{"type": "file"}]}], "InvalidInput"),
            ({}, [answered([])], "InvalidInput"),  # an assistant message answering nothing
        ):
            status, _, (problem,) = await chat(client, "c", *messages, **extra)
            assert (status, problem["error"]) == (422, error), problem
        status, _, (problem,) = await chat(client, "c", answered([("call-9", True)]))
        assert (status, problem["error"]) == (404, "UnknownConversation")
        assert await rt.store.head("c") is None  # nothing was logged


async def test_a_postponed_message_streams_its_own_answer_not_the_one_before() -> None:
    halfway, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("first answer, "), Signal(halfway), Wait(go),
                            Text("still the first.")], "the second answer."])
    async with Runtime("sqlite://", model=model) as rt, served(rt) as (
        _, client, _app
    ), anyio.create_task_group() as tg:
        firsts: list[Any] = []
        seconds: list[Any] = []

        async def first() -> None:
            firsts.extend((await chat(client, "p", user("one", "u1")))[2])

        tg.start_soon(first)
        await halfway.wait()  # the first answer streams: the second message waits
        follower = rt.subscribe("p")

        async def later() -> None:
            seconds.extend((await chat(client, "p", user("one", "u1"), user("two", "u2")))[2])

        tg.start_soon(later)
        async for item in follower:  # until the second message is logged
            if isinstance(item, Event) and item.body == UserMessage("two"):
                break
        follower.close()
        go.set()
    assert text(firsts) == "first answer, still the first."
    assert text(seconds) == "the second answer."
    assert seconds[0] == {"type": "start", "messageId": "turn-2"}
    assert types(seconds)[-2:] == ["finish", "[DONE]"]


async def test_approvals_answered_one_at_a_time_and_a_retry_replays() -> None:
    model = ScriptedModel([[Call("approve", {}, id="a"), Call("approve", {}, id="b")],
                           "both answered."])
    async with Runtime("sqlite://", model=model,
                       agent=AgentConfig(tools=[APPROVE])) as rt, served(rt) as (_, client, _a):
        _, _, asked = await chat(client, "q", user("go"))
        requests = [c for c in asked if isinstance(c, dict)
                    and c["type"] == "tool-approval-request"]
        assert [(c["approvalId"], c["toolCallId"]) for c in requests] == [("a", "a"), ("b", "b")]
        assert asked[-2] == {"type": "finish", "finishReason": "tool-calls"}
        # one answer of two: its output, and the message waits for the other
        _, _, one = await chat(client, "q", user("go"), answered([("a", True)]))
        assert one == [{"type": "start", "messageId": "turn-1"},
                       {"type": "tool-output-available", "toolCallId": "a", "output": "approved"},
                       {"type": "finish", "finishReason": "tool-calls"}, "[DONE]"]
        # the SDK then sends both answers (its message holds both): "a" again is a replay
        _, _, both = await chat(client, "q", user("go"),
                                answered([("a", True), ("b", False)]))
        assert {"type": "tool-output-denied", "toolCallId": "b"} in both
        assert text(both) == "both answered."
        # the same request once more (its response was lost): the same continuation
        _, _, again = await chat(client, "q", user("go"),
                                 answered([("a", True), ("b", False)]))
        assert text(again) == "both answered." and again[-1] == "[DONE]"
        # the user message retried (same UI message id): the same turn, logged once
        _, _, retried = await chat(client, "q", user("go"))
        assert retried[0] == {"type": "start", "messageId": "turn-1"}
        logged = [e.body for e in await rt.history("q", limit=100)]
        assert sum(type(b).__name__ == "UserMessage" for b in logged) == 1
        results = {b.call_id: b.content for b in logged if type(b).__name__ == "ToolResult"}
        assert results == {"a": "approved", "b": "denied"}
