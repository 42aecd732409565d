"""A redacted tool-call exchange still renders as valid provider requests (llm adapters).

The assistant message that made a call keeps the call's id and name, its arguments
dropped; the tool result keeps its call id. What the next model call is sent, rendered
by the OpenAI and Anthropic adapters: every tool result pairs with a call of the
assistant message just before it, arguments are a JSON object ("{}" / {}), and the
secret the arguments and the result held is in neither request.
"""

from __future__ import annotations

import json
from pathlib import Path

from torpor import AgentConfig, Runtime, ScriptedModel, tool
from torpor.events import REDACTED_TEXT, AssistantMessage, ToolResult
from torpor.llm import Call, Text
from torpor.llm.anthropic_messages import anthropic_request
from torpor.llm.openai_chat import openai_messages

SECRET = "kqzredactedargs5150"


async def test_a_redacted_call_and_result_render_for_both_providers(tmp_path: Path) -> None:
    @tool
    async def login(password: str) -> str:
        """Log in."""
        return f"logged in with {password}"

    model = ScriptedModel([[Call("login", {"password": SECRET}, id="call-1")], [Text("done")],
                           [Text("fine")]])
    async with Runtime(f"sqlite:///{tmp_path / 'rt.db'}",
                       agent=AgentConfig(model=model, tools=[login])) as rt:
        await (await rt.send("c", "log me in")).result()
        events = list(reversed(await rt.history("c")))
        asked = next(e for e in events if isinstance(e.body, AssistantMessage)
                     and e.body.tool_calls)
        result = next(e for e in events if isinstance(e.body, ToolResult))
        assert SECRET in repr(asked.body) and SECRET in repr(result.body)
        assert await rt.redact("c", asked.position) is True
        assert await rt.redact("c", result.position) is True
        await (await rt.send("c", "and now?")).result()
    context = model.calls[-1]
    assert SECRET not in repr(context)

    messages = openai_messages(context)
    assert SECRET not in json.dumps(messages)
    calls = [m for m in messages if m.get("tool_calls")]
    assert len(calls) == 1 and calls[0]["content"] == REDACTED_TEXT
    (function,) = [c["function"] for c in calls[0]["tool_calls"]]
    assert function["name"] == "login" and json.loads(function["arguments"]) == {}
    at = messages.index(calls[0])
    assert messages[at + 1] == {"role": "tool", "tool_call_id": "call-1",
                                "content": REDACTED_TEXT}

    _system, turns, _tools = anthropic_request(context, [])
    assert SECRET not in json.dumps(turns)
    uses = [(i, b) for i, m in enumerate(turns) if m["role"] == "assistant"
            for b in m["content"] if b["type"] == "tool_use"]
    assert len(uses) == 1
    index, use = uses[0]
    assert (use["name"], use["input"]) == ("login", {})
    answered = [b for b in turns[index + 1]["content"] if b["type"] == "tool_result"]
    assert [(b["tool_use_id"], b["content"]) for b in answered] == [(use["id"], REDACTED_TEXT)]
    assert turns[index + 1]["role"] == "user"
