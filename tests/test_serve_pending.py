"""``GET /v1/conversations/{id}/pending`` over HTTP: the calls still waiting for an answer,
with their tool, arguments and since when, from the store's index (read permission)."""

from __future__ import annotations

import httpx
from serve_support import served

from torpor import AgentConfig, ExternalTool, Runtime, ScriptedModel
from torpor.llm.scripted import Call, Text
from torpor.serve import bearer_tokens

APPROVE = ExternalTool("approve", "Ask a person.", {"type": "object", "properties": {}})
ALICE = {"Authorization": "Bearer alice-token"}


async def test_pending_lists_open_calls_until_they_are_answered() -> None:
    model = ScriptedModel([
        [Text("asking"), Call("approve", {"what": "deploy 🚀"}, id="call-1"),
         Call("approve", {"what": "rollback"}, id="call-2")],
        "both answered",
    ])
    users = bearer_tokens({"alice-token": "alice", "bob-token": "bob"})
    async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[APPROVE])) as rt:
        await (await rt.send("alice:1", "deploy")).result()
        suspended = (await rt.history("alice:1", limit=1))[0]
        async with served(rt, authorize=users) as (url, _, _), httpx.AsyncClient() as http:
            pending = f"{url}/v1/conversations/alice:1/pending"
            got = await http.get(pending, headers=ALICE)
            assert got.status_code == 200, got.text
            assert got.json() == {"calls": [
                {"call_id": "call-1", "tool": "approve", "arguments": {"what": "deploy 🚀"},
                 "since": suspended.created_at, "position": suspended.position},
                {"call_id": "call-2", "tool": "approve", "arguments": {"what": "rollback"},
                 "since": suspended.created_at, "position": suspended.position},
            ]}
            answered = await http.post(f"{url}/v1/conversations/alice:1/calls/call-1",
                                       json={"result": "yes"}, headers={
                                           **ALICE, "Accept": "application/json"})
            assert answered.status_code == 202
            assert [c["call_id"] for c in (await http.get(pending, headers=ALICE)).json()[
                "calls"]] == ["call-2"]
            await http.post(f"{url}/v1/conversations/alice:1/calls/call-2",
                            json={"result": "yes"}, headers={**ALICE, "Accept": "application/json"})
            assert (await http.get(pending, headers=ALICE)).json() == {"calls": []}
            # read permission: bob may not, nobody without a token may
            bob = await http.get(pending, headers={"Authorization": "Bearer bob-token"})
            assert bob.status_code == 403
            assert (await http.get(pending)).status_code == 401
            unknown = await http.get(f"{url}/v1/conversations/alice:none/pending",
                                     headers=ALICE)
            assert unknown.status_code == 404
            assert unknown.json()["error"] == "UnknownConversation"
