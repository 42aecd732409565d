"""Runtime.redact over a real store, with a live agent (actors.redaction, store.redact).

A secret in one user message is folded into a model summary, indexed, and seen by
the model; after the redaction its bytes are in no file of the SQLite store, no read
finds it, the rest of the conversation stays, and the agent answers on, its next
model call showing "[redacted]" where the message was. A redacted tool result still
answers its call. A redaction racing a running turn waits for it, then redacts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import pytest

from torpor import (
    AgentConfig,
    EchoModel,
    InvalidInput,
    ModelSummarizer,
    Redacted,
    Runtime,
    ScriptedModel,
    UnknownConversation,
    tool,
)
from torpor.events import REDACTED_TEXT, AssistantMessage, ToolResult, UserMessage
from torpor.llm import Call, Signal, Text, Wait
from torpor.llm.protocol import ContextMessage, SystemMessage

SECRET = "zqxsecretwombat7731"
SMALL = dict(working_budget=150, tail_turns=1, context_window=4_000, max_output_tokens=500,
             safety_margin=100, recall_tools=False)


def _texts(call: list[ContextMessage]) -> str:
    parts: list[str] = []
    for message in call:
        if isinstance(message, SystemMessage | UserMessage):
            parts.append(message.text)
        elif isinstance(message, AssistantMessage):
            parts.append(message.text + repr(message.tool_calls))
        elif isinstance(message, ToolResult):
            parts.append(message.content)
    return "\n".join(parts)


async def test_a_redacted_message_leaves_no_copy_and_the_agent_answers_on(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "store"
    folder.mkdir()
    model = ScriptedModel([[Text("ok")]], loop=True)
    # The summarizer echoes the transcript it is given: a fold's summary holds the secret.
    summarizer = ModelSummarizer(EchoModel())
    agent = AgentConfig(model=model, summarizer=summarizer, **SMALL)
    async with Runtime(f"sqlite:///{folder / 'rt.db'}", agent=agent) as rt:
        await (await rt.send("c", f"my password is {SECRET}")).result()
        for i in range(5):
            filler = f"note {i}: " + " ".join(f"detail{j}" for j in range(25))
            await (await rt.send("c", filler)).result()
        # Before: the secret is in a fold's summary, memory, the index and a model call.
        summaries = [cp.summary for cp in await rt.store.checkpoints("c")]
        assert any(SECRET in s for s in summaries), summaries
        assert await rt.recall("c", SECRET) != []
        assert any(SECRET in _texts(call) for call in model.calls)
        calls_before = len(await rt.store.model_calls("c", limit=1000))
        seen_before = len(model.calls)

        assert await rt.redact("c", 0, reason="pasted a password") is True

        files = {f.name: f.read_bytes() for f in folder.iterdir()}
        assert [n for n, data in files.items() if SECRET.encode() in data] == []
        assert await rt.recall("c", SECRET) == []
        history = await rt.history("c", limit=100)
        assert not any(SECRET in repr(e.body) for e in history)
        first = history[-1]
        assert first.position == 0 and isinstance(first.body, Redacted)
        assert first.body.kind == "user" and first.body.reason == "pasted a password"
        assert len(history) == 12  # the rest intact, positions dense
        assert [e.position for e in reversed(history)] == list(range(12))
        assert SECRET not in repr(await rt.admin.inspect("c"))
        assert SECRET not in repr(await rt.admin.memory("c"))
        assert all(SECRET not in repr(c) for c in await rt.store.model_calls("c", limit=1000))
        # An earlier call's rebuild names the redaction instead of failing on it.
        earlier = await rt.admin.rendered("c", 0)
        assert earlier.redacted == (0,) and not earlier.matches
        assert SECRET not in repr(earlier.rendered.messages)

        # The agent answers on; its next call shows the redaction, never the secret.
        await (await rt.send("c", "what did I say first?")).result()
        after = model.calls[seen_before:]
        assert after and all(SECRET not in _texts(call) for call in after)
        assert REDACTED_TEXT in _texts(after[-1])
        assert len(await rt.store.model_calls("c", limit=1000)) > calls_before
        assert await rt.redact("c", 0, reason="pasted a password") is False  # twice: no-op
        with pytest.raises(InvalidInput):
            await rt.redact("c", 0, reason="another reason")
        with pytest.raises(InvalidInput):
            await rt.redact("c", 10_000)
        with pytest.raises(UnknownConversation):
            await rt.redact("nobody", 0)
        for file in folder.iterdir():
            assert SECRET.encode() not in file.read_bytes(), file.name
    for file in folder.iterdir():
        assert SECRET.encode() not in file.read_bytes(), file.name


async def test_a_redacted_tool_result_still_answers_its_call(tmp_path: Path) -> None:
    @tool
    async def lookup(key: str) -> str:
        """Look a key up."""
        return f"the value is {SECRET}"

    model = ScriptedModel([[Call("lookup", {"key": "k"}, id="call-1")], [Text("got it")],
                           [Text("fine")]])
    agent = AgentConfig(model=model, tools=[lookup])
    async with Runtime(f"sqlite:///{tmp_path / 'rt.db'}", agent=agent) as rt:
        await (await rt.send("c", "look it up")).result()
        events = list(reversed(await rt.history("c")))
        result = next(e for e in events if isinstance(e.body, ToolResult))
        assert await rt.redact("c", result.position) is True
        await (await rt.send("c", "and now?")).result()
        last = model.calls[-1]
        calls = [m for m in last if isinstance(m, AssistantMessage) and m.tool_calls]
        results = [m for m in last if isinstance(m, ToolResult)]
        assert [c.tool_calls[0].id for c in calls] == ["call-1"]
        assert [(r.call_id, r.tool, r.content) for r in results] == [
            ("call-1", "lookup", REDACTED_TEXT)
        ]
        assert SECRET not in _texts(last)
        # The assistant message that made the call: its arguments go, its id and name stay.
        asked = next(e for e in events if isinstance(e.body, AssistantMessage))
        assert await rt.redact("c", asked.position) is True
        body = (await rt.store.read_range("c", asked.position, asked.position))[0].body
        assert isinstance(body, Redacted) and body.tool_calls[0].arguments == {}
        assert [(c.id, c.name) for c in body.tool_calls] == [("call-1", "lookup")]


async def test_a_redaction_racing_a_running_turn_waits_for_it(tmp_path: Path) -> None:
    reached, release = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("first")], [Signal(reached), Wait(release), Text("second")],
                           [Text("third")]])
    async with Runtime(f"sqlite:///{tmp_path / 'rt.db'}", agent=AgentConfig(model=model)) as rt:
        await (await rt.send("c", f"my password is {SECRET}")).result()
        turn = await rt.send("c", "go on")
        await reached.wait()  # the turn's model call runs
        redacting = asyncio.ensure_future(rt.redact("c", 0))
        agent = rt._registry.get("c")
        assert agent is not None
        for _ in range(1000):  # until the actor took it (a few loop passes)
            if agent.redactions:
                break
            await asyncio.sleep(0)
        assert agent.redactions, "the actor held the redaction back for the turn"
        # Nothing redacted while the turn runs: no fold of it may copy the text after.
        assert isinstance((await rt.store.read_range("c", 0, 0))[0].body, UserMessage)
        assert not redacting.done()
        release.set()
        await turn.result()
        assert await redacting is True
        events = list(reversed(await rt.history("c")))
        assert [e.position for e in events] == list(range(len(events)))
        assert isinstance(events[0].body, Redacted)
        assert [type(e.body) for e in events[1:]] == [AssistantMessage, UserMessage,
                                                      AssistantMessage]
        await (await rt.send("c", "again")).result()
        assert SECRET not in _texts(model.calls[-1])
        assert REDACTED_TEXT in _texts(model.calls[-1])
