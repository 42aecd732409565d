"""A model's tool calls that are wrong: arguments that break an external tool's schema are an
error result the model reads and can correct, not a suspension."""

from __future__ import annotations

from typing import Any

from torpor import AgentConfig, Runtime, ScriptedModel, Suspended, ToolResult
from torpor.actors.tools import ExternalTool
from torpor.llm import Call

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
