"""How torpor's context becomes each provider's payload, what the adapters make of unusual
streams, and how they are imported: lazily, naming the extra when the SDK is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from providers import OPENAI
from replay import ReplayServer, Reply

from torpor.events import AssistantMessage, ToolCall, ToolResult, UserMessage
from torpor.llm.anthropic_messages import (
    EMPTY_TEXT,
    LEFT_OUT,
    MAX_BREAKPOINTS,
    anthropic_request,
)
from torpor.llm.openai_chat import openai_messages, openai_tools
from torpor.llm.protocol import ContextMessage, SystemMessage, ToolSpec

ROOT = Path(__file__).resolve().parents[1]
LOOKUP = ToolSpec("lookup", "weather", {"type": "object",
                                        "properties": {"city": {"type": "string"}}})
CONTEXT: list[ContextMessage] = [
    SystemMessage("Be brief."),
    SystemMessage("Earlier turns were folded."),
    UserMessage("weather?"),
    AssistantMessage("", (ToolCall("call.1", "lookup", {"city": "Oslo"}),
                          ToolCall("call 2", "lookup", {"city": "Lima"}))),
    ToolResult("call.1", "lookup", "sunny"),
    ToolResult("call 2", "lookup", "tool 'lookup' raised KeyError", is_error=True),
    AssistantMessage("Oslo is sunny."),
    UserMessage("thanks"),
]


def test_openai_messages() -> None:
    messages = openai_messages(CONTEXT)
    assert messages[0] == {"role": "system",
                           "content": "Be brief.\n\nEarlier turns were folded."}
    assert messages[2] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call.1", "type": "function",
         "function": {"name": "lookup", "arguments": '{"city":"Oslo"}'}},
        {"id": "call 2", "type": "function",
         "function": {"name": "lookup", "arguments": '{"city":"Lima"}'}}]}
    assert messages[3:5] == [
        {"role": "tool", "tool_call_id": "call.1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call 2", "content": "tool 'lookup' raised KeyError"}]
    assert messages[-1] == {"role": "user", "content": "thanks"}
    assert openai_messages(CONTEXT) == messages  # the same context, the same payload
    assert openai_tools([LOOKUP])[0]["function"]["parameters"] == LOOKUP.parameters


def test_anthropic_request() -> None:
    system, messages, tools = anthropic_request(CONTEXT, [LOOKUP])
    assert [b["text"] for b in system] == ["Be brief.", "Earlier turns were folded."]
    assert all(b["cache_control"] == {"type": "ephemeral"} for b in system)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    uses = messages[1]["content"]
    assert [b["type"] for b in uses] == ["tool_use", "tool_use"]  # no empty text block
    assert [b["id"] for b in uses] == ["call_1", "call_2"]  # ids the API accepts
    results = messages[2]["content"]
    assert [b["tool_use_id"] for b in results] == ["call_1", "call_2"]
    assert "is_error" not in results[0] and results[1]["is_error"] is True
    # Breakpoints: system prompt, handoff, the answer before the newest ask, the final block.
    assert "cache_control" in messages[3]["content"][-1]
    assert "cache_control" in messages[4]["content"][-1]
    assert sum("cache_control" in b for m in messages for b in m["content"]) == 2
    assert tools == [{"name": "lookup", "description": "weather",
                      "input_schema": LOOKUP.parameters}]
    _, plain, _ = anthropic_request(CONTEXT, [], cache=False)
    assert "cache_control" not in json.dumps(plain)
    system, _, _ = anthropic_request(CONTEXT, [], ttl="1h")
    assert system[0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}


def test_anthropic_edge_cases() -> None:
    _, messages, _ = anthropic_request(
        [AssistantMessage("an answer whose question was cut"), UserMessage(""),
         AssistantMessage("")], [])
    assert messages[0] == {"role": "user", "content": [{"type": "text", "text": LEFT_OUT}]}
    assert messages[2]["content"][0]["text"] == EMPTY_TEXT  # the API refuses empty text
    assert messages[3]["content"][0]["text"] == EMPTY_TEXT


MESSAGES = st.one_of(
    st.builds(UserMessage, st.text(max_size=5)),
    st.builds(AssistantMessage, st.text(max_size=5)),
    st.builds(lambda n: AssistantMessage("", (ToolCall(f"c{n}", "lookup", {}),)),
              st.integers(0, 3)),
    st.builds(lambda n: ToolResult(f"c{n}", "lookup", "r"), st.integers(0, 3)),
)


@settings(max_examples=200, deadline=None)
@given(system=st.lists(st.text(min_size=1, max_size=5).map(SystemMessage), max_size=3),
       rest=st.lists(MESSAGES, max_size=12))
def test_anthropic_breakpoints_never_exceed_the_limit(system: list[SystemMessage],
                                                      rest: list[ContextMessage]) -> None:
    blocks, messages, _ = anthropic_request([*system, *rest], [])
    marked = [b for m in messages for b in m["content"] if "cache_control" in b]
    marked += [b for b in blocks if "cache_control" in b]
    assert len(marked) <= MAX_BREAKPOINTS
    if messages:
        assert messages[0]["role"] == "user"
        assert "cache_control" in messages[-1]["content"][-1]  # the final block, always
    assert all(b["text"] for m in messages for b in m["content"] if b["type"] == "text")


def test_import_torpor_pulls_in_no_sdk_and_a_missing_one_names_its_extra() -> None:
    code = """
import sys
import torpor, torpor.llm
assert "openai" not in sys.modules and "anthropic" not in sys.modules, "imported eagerly"
from torpor.llm import OpenAIChatModel, AnthropicModel
assert OpenAIChatModel.__name__ == "OpenAIChatModel"
sys.modules.pop("torpor.llm.anthropic_messages")
del torpor.llm.__dict__["AnthropicModel"]
sys.modules["anthropic"] = None
try:
    from torpor.llm import AnthropicModel
except ImportError as exc:
    print(exc)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "pip install 'torpor[anthropic]'" in result.stdout


async def test_tool_calls_from_a_server_without_ids_or_indexes() -> None:
    """Some OpenAI-compatible servers send neither call ids nor fragment indexes."""

    def chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
        payload = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    chunks = [
        chunk({"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"function": {"arguments": '"Oslo"}'}}]}),
        chunk({"tool_calls": [{"id": "b", "function": {"name": "lookup", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"),
        b"data: [DONE]\n\n",
    ]
    async with ReplayServer() as server:
        server.add(Reply(chunks))
        events = [e async for e in OPENAI.model(server).stream([UserMessage("hi")], [LOOKUP])]
    calls = [e.call for e in events if hasattr(e, "call")]
    assert [(c.name, c.arguments) for c in calls] == [("lookup", {"city": "Oslo"}),
                                                      ("lookup", {})]
    assert calls[0].id.startswith("call_") and calls[1].id == "b"
