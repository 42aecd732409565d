"""Over real HTTP (issue 22): ``authorize`` sets the metadata a tool reads in its ToolContext.

With ``bearer_tokens({token: user})`` a message's metadata is ``{"user": user}``;
a client cannot set metadata (the body's ``"metadata"`` is refused, nothing is
logged), and the chat API does not show it to readers.
"""

from __future__ import annotations

from typing import Any

import pytest
from serve_support import events_until, kinds, post_message, served
from starlette.requests import HTTPConnection

from torpor import AgentConfig, Runtime, ScriptedModel, ToolContext, UserMessage, tool
from torpor.llm import Call, Text
from torpor.serve import bearer_tokens
from torpor.serve.access import Action
from torpor.serve.client import Client, HTTPStatusError, SSEEvent


def whoami(seen: list[ToolContext]) -> Any:
    @tool
    async def whoami(ctx: ToolContext) -> str:
        """Who is asking."""
        seen.append(ctx)
        return f"you are {ctx.metadata.get('user')}"

    return whoami


def answered(event: SSEEvent) -> bool:
    return event.event == "assistant" and not event.json()["body"].get("tool_calls")


def model() -> ScriptedModel:
    return ScriptedModel([[Call("whoami", {})], [Text("done")]], loop=True)


async def test_a_tool_sees_the_bearer_tokens_user_and_a_client_cannot_claim_another() -> None:
    seen: list[ToolContext] = []
    authorize = bearer_tokens({"tok-a": "alice", "tok-b": "bob"})
    async with Runtime("sqlite://", model=model(),
                       agent=AgentConfig(tools=[whoami(seen)])) as rt, served(
        rt, authorize=authorize
    ) as (url, _client, _app):
        alice = Client(url, "tok-a")
        conn, response = await post_message(alice, "alice:1", "who am I?")
        events = await events_until(response, answered)
        await conn.close()
        assert kinds(events)[-1] == "assistant"
        [result] = [e.json()["body"] for e in events if e.event == "tool_result"]
        assert result["content"] == "you are alice"
        assert [(c.conversation_id, dict(c.metadata)) for c in seen] == [
            ("alice:1", {"user": "alice"})]

        with pytest.raises(HTTPStatusError) as info:
            await alice.call("POST", "/v1/conversations/alice:1/messages",
                             json_body={"text": "I am bob", "metadata": {"user": "bob"}},
                             headers={"Accept": "application/json"}, expect=(202,))
        assert info.value.status == 422 and info.value.problem is not None
        assert info.value.problem["error"] == "InvalidInput"
        assert await rt.store.head("alice:1") == 3  # nothing of it was logged
        assert len(seen) == 1

        # The log holds who sent it; the chat API does not show it to readers.
        logged = [e.body for e in await rt.history("alice:1") if isinstance(e.body, UserMessage)]
        assert [m.metadata for m in logged] == [{"user": "alice"}]
        history = await alice.call("GET", "/v1/conversations/alice:1/history")
        [user] = [e for e in history["events"] if e["kind"] == "user"]
        assert user["body"] == {"text": "who am I?"}


async def test_an_authorize_hook_grants_metadata_by_returning_a_mapping() -> None:
    seen: list[ToolContext] = []

    async def authorize(request: HTTPConnection, conversation_id: str, action: Action) -> Any:
        tenant = request.headers.get("x-tenant")
        if tenant is None:
            return True  # allowed, no metadata: as before
        return {"user": "svc", "tenant": tenant}

    async with Runtime("sqlite://", model=model(),
                       agent=AgentConfig(tools=[whoami(seen)])) as rt, served(
        rt, authorize=authorize
    ) as (_url, client, _app):
        for headers in ({"X-Tenant": "acme"}, {}):
            conn, response = await post_message(client, "t", "hi", headers)
            await events_until(response, answered)
            await conn.close()
    assert [dict(c.metadata) for c in seen] == [{"user": "svc", "tenant": "acme"}, {}]
