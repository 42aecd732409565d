"""A model's tool calls that are wrong: a malformed call is the model's error (``model_error``,
never a crash, never a reason to park); arguments that break a tool's schema are an error
result the model reads and can correct, for local and external tools alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from torpor import (
    Aborted,
    AgentConfig,
    ModelResponseError,
    Parked,
    Runtime,
    ScriptedModel,
    Suspended,
    ToolResult,
    TurnAborted,
)
from torpor.actors.tools import ExternalTool, tool
from torpor.events import AssistantMessage
from torpor.llm import Call, Text

runs: list[tuple[int, int]] = []


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    runs.append((a, b))
    return a + b


# Six kinds of malformed call, one per turn: none of them may reach the tool or the log.
MALFORMED: list[tuple[Call, str]] = [
    (Call("add", '{"a": 1', id="m1"), "not a JSON object"),  # invalid JSON text
    (Call("add", "[1, 2]", id="m2"), "not a JSON object"),  # JSON, but not an object
    (Call("add", [1, 2], id="m3"), "must be a dict"),  # not an object at all
    (Call("add", {"a": {1, 2}}, id="m4"), "set is not a JSON value"),
    (Call("add", {1: 2}, id="m5"), "keys must be str"),
    (Call(7, {"a": 1, "b": 2}, id="m6"), "name and id must be str"),  # type: ignore[arg-type]
]


async def test_malformed_tool_calls_end_each_turn_as_model_error_and_never_park(
    tmp_path: Path,
) -> None:
    runs.clear()
    model = ScriptedModel([[call] for call, _ in MALFORMED] + [[Text("fine")]])
    url = f"sqlite:///{tmp_path}/m.db"
    async with Runtime(url, model=model, agent=AgentConfig(tools=[add])) as rt:
        for i, (_, fragment) in enumerate(MALFORMED):
            turn = await rt.send("c", f"try {i}")
            with pytest.raises(TurnAborted) as info:
                await turn.result()
            assert info.value.reason == "model_error"
            assert isinstance(info.value.error, ModelResponseError)
            assert fragment in info.value.detail
        # The sixth such turn in a row, and the conversation still answers.
        assert (await (await rt.send("c", "and now?")).result()).text == "fine"
        stats = await rt.admin.stats()
        assert stats.crashes == 0 and stats.parks == 0 and stats.restarts == 0
        assert (await rt.admin.inspect("c")).state == "awaiting_input"
        bodies = [e.body for e in reversed(await rt.history("c", limit=100))]
        aborts = [b for b in bodies if isinstance(b, Aborted)]
        assert [a.reason for a in aborts] == ["model_error"] * len(MALFORMED)
        for abort, (_, fragment) in zip(aborts, MALFORMED, strict=True):
            assert "ModelResponseError" in abort.detail and fragment in abort.detail
        assert not any(isinstance(b, Parked) for b in bodies)
        # Nothing of the bad calls was logged or run; each call is in the audit, failed.
        assert not any(isinstance(b, AssistantMessage) and b.tool_calls for b in bodies)
        assert runs == []
        audit = await rt.store.model_calls("c", limit=100)
        failed = [c for c in audit if c.error is not None]
        assert len(failed) == len(MALFORMED)
        assert all("ModelResponseError" in (c.error or "") for c in failed)


async def test_arguments_given_as_json_text_are_decoded_and_the_tool_runs() -> None:
    runs.clear()
    model = ScriptedModel([
        [Call("add", ' {"a": 2, "b": 3} ', id="t1")],
        [Text("five")],
    ])
    async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[add])) as rt:
        assert (await (await rt.send("c", "add them")).result()).text == "five"
        assert runs == [(2, 3)]
        bodies = [e.body for e in reversed(await rt.history("c", limit=10))]
        (asked,) = [b for b in bodies if isinstance(b, AssistantMessage) and b.tool_calls]
        assert asked.tool_calls[0].arguments == {"a": 2, "b": 3}  # logged decoded
        (result,) = [b for b in bodies if isinstance(b, ToolResult)]
        assert result.content == "5" and not result.is_error


async def test_two_calls_with_one_id_in_an_answer_are_the_models_error() -> None:
    model = ScriptedModel([
        [Call("add", {"a": 1, "b": 1}, id="same"), Call("add", {"a": 2, "b": 2}, id="same")],
        [Text("ok")],
    ])
    async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[add])) as rt:
        with pytest.raises(TurnAborted) as info:
            await (await rt.send("c", "twice")).result()
        assert info.value.reason == "model_error" and "has that id" in info.value.detail
        assert (await (await rt.send("c", "again")).result()).text == "ok"


async def test_local_arguments_that_break_the_signature_are_a_result_the_model_corrects() -> None:
    runs.clear()
    model = ScriptedModel([
        [Call("add", {"a": "one", "b": 2}, id="bad")],
        [Call("add", {"a": 1, "b": 2}, id="good")],
        [Text("three")],
    ])
    async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[add])) as rt:
        assert (await (await rt.send("c", "add")).result()).text == "three"
        assert runs == [(1, 2)]
        results = _results(await rt.history("c", limit=20))
        assert results["bad"].is_error and "invalid arguments for tool 'add'" in (
            results["bad"].content
        )
        assert results["good"].content == "3" and not results["good"].is_error


SHIP = ExternalTool(
    "ship",
    "Ship an order once a person approves it.",
    {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "qty": {"type": "integer", "minimum": 1},
        },
        "required": ["sku", "qty"],
        "additionalProperties": False,
    },
)


async def test_external_arguments_that_break_the_schema_are_answered_at_once_not_suspended(
) -> None:
    """Without the schema check the first call would suspend the turn on arguments nobody
    can act on: this test fails when the check always passes."""
    model = ScriptedModel([
        [Call("ship", {"sku": "abc-1", "qty": "lots"}, id="bad")],
        [Call("ship", {"sku": "ABC-1234", "qty": 2}, id="good")],
    ])
    async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[SHIP])) as rt:
        outcome = await (await rt.send("c", "ship two ABC-1234")).result()
        assert isinstance(outcome, Suspended) and outcome.call_ids == ("good",)
        results = _results(await rt.history("c", limit=20))
        bad = results["bad"]
        assert bad.is_error and bad.tool == "ship"
        assert bad.content.startswith("invalid arguments for tool 'ship': ")
        assert "arguments.sku: 'abc-1' does not match" in bad.content  # each failing path
        assert "arguments.qty: 'lots' is not of type 'integer'" in bad.content
        assert [p.conversation_id for p in await rt.admin.pending()] == ["c"]


def _results(events: list[Any]) -> dict[str, ToolResult]:
    return {e.body.call_id: e.body for e in events if isinstance(e.body, ToolResult)}
