"""Tools that know their caller (issue 22): ``ToolContext`` and ``send(metadata=)``.

A local tool that declares a parameter annotated ``ToolContext`` gets the
conversation, the turn, the call and the metadata of the turn's user message;
the model never sees the parameter. The metadata is in the log with the
message, so a postponed, queued, resumed or revived turn has it; what cannot be
logged within the bound is refused before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from tests.test_runtime_lifecycle import APPROVE
from torpor import (
    MAX_METADATA_BYTES,
    AgentConfig,
    ConfigError,
    IdempotencyConflict,
    InvalidInput,
    Runtime,
    RuntimeConfig,
    ScriptedModel,
    Suspended,
    ToolContext,
    ToolResult,
    UserMessage,
    tool,
)
from torpor.actors.turn_context import turn_metadata
from torpor.events import AssistantMessage, ToolCall, encode_body
from torpor.llm import Call, Text
from torpor.llm.protocol import ContextMessage, StreamEvent, TextDelta, ToolCallDelta, ToolSpec
from torpor.store import SQLiteStore


def whoami(seen: list[ToolContext]) -> Any:
    @tool
    async def whoami(ctx: ToolContext) -> str:
        """Who is asking."""
        seen.append(ctx)
        return str(ctx.metadata.get("user"))

    return whoami


class WhoAmIModel:
    """Per conversation, whatever the order: a user message asks ``whoami``, its result is
    the answer. A message starting with "hold" waits for ``gate`` first."""

    name = "whoami"

    def __init__(self) -> None:
        self.gate = anyio.Event()
        self.held = anyio.Event()
        self.calls = 0

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        last = context[-1]
        if isinstance(last, UserMessage):
            if last.text.startswith("hold"):
                self.held.set()
                await self.gate.wait()
            self.calls += 1
            yield ToolCallDelta(ToolCall(f"w{self.calls}", "whoami", {}))
        else:
            assert isinstance(last, ToolResult)
            yield TextDelta(last.content)


async def test_a_tool_gets_its_call_context_and_the_model_never_sees_it() -> None:
    seen: list[ToolContext] = []

    @tool
    async def order_status(order_id: str, context: ToolContext) -> str:
        """Look an order up.

        Args:
            order_id: the order's number
        """
        seen.append(context)
        return f"{order_id} of {context.metadata['user']}"

    assert order_status.context == "context"
    model = ScriptedModel([[Call("order_status", {"order_id": "o-1"}, id="k-1")], "done"])
    async with Runtime("sqlite://", model=model,
                       agent=AgentConfig(tools=[order_status])) as rt:
        turn = await rt.send("c", "where is my order",
                             metadata={"user": "alice", "roles": ("buyer",)})
        assert (await turn.result()).text == "done"
        log = list(reversed(await rt.history("c")))
    [spec] = [s for s in model.tool_specs[0] if s.name == "order_status"]
    assert spec.parameters == {
        "type": "object",
        "properties": {"order_id": {"type": "string", "description": "the order's number"}},
        "required": ["order_id"],
        "additionalProperties": False,
    }
    [ctx] = seen
    assert (ctx.conversation_id, ctx.turn, ctx.call_id, ctx.tool_name) == (
        "c", 1, "k-1", "order_status")
    assert dict(ctx.metadata) == {"user": "alice", "roles": ["buyer"]}
    with pytest.raises(TypeError):
        ctx.metadata["user"] = "mallory"  # type: ignore[index]
    assert log[0].body == UserMessage("where is my order", {"user": "alice", "roles": ["buyer"]})
    assert isinstance(log[2].body, ToolResult) and log[2].body.content == "o-1 of alice"
    assert await order_status("o-2", context=ctx) == "o-2 of alice"  # still a function


async def test_a_model_cannot_pass_the_context_itself() -> None:
    seen: list[ToolContext] = []
    forged = {"metadata": {"user": "mallory"}}
    model = ScriptedModel([[Call("whoami", {"ctx": forged}, id="x")], "ok"])
    async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[whoami(seen)])) as rt:
        await (await rt.send("c", "hi", metadata={"user": "alice"})).result()
        result = [e.body for e in await rt.history("c") if isinstance(e.body, ToolResult)]
    assert not seen
    assert result[0].is_error and "ctx" in result[0].content


def test_only_a_parameter_annotated_exactly_tool_context_gets_it() -> None:
    async def maybe(ctx: ToolContext | None = None) -> str:
        return ""

    async def twice(a: ToolContext, b: ToolContext) -> str:
        return ""

    with pytest.raises(ConfigError, match="exactly ToolContext"):
        tool(maybe)
    with pytest.raises(ConfigError, match="one is enough"):
        tool(twice)

    async def plain(x: int) -> int:
        return x

    assert tool(plain).context is None


async def test_metadata_follows_its_turn_through_an_approval_and_a_restart(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path}/t.db"
    seen: list[ToolContext] = []
    config = AgentConfig(tools=[APPROVE, whoami(seen)])
    model = ScriptedModel([[Call("approve", {"what": "refund"}, id="a1")]])
    async with Runtime(url, model=model, agent=config) as rt:
        first = await rt.send("c", "refund me", metadata={"user": "alice"})
        assert isinstance(await first.result(), Suspended)
    # A new process: the agent is revived from the log, its working set read afresh.
    model = ScriptedModel([[Call("whoami", {}, id="w1")], [Text("refunded")],
                           [Call("whoami", {}, id="w2")], [Text("hello bob")]])
    async with Runtime(url, model=model, agent=config) as rt:
        cont = await rt.resolve("c", "a1", "approved")
        assert cont is not None and (await cont.result()).text == "refunded"
        second = await rt.send("c", "and me?", metadata={"user": "bob"})
        assert (await second.result()).text == "hello bob"
    assert [(c.turn, c.call_id, dict(c.metadata)) for c in seen] == [
        (1, "w1", {"user": "alice"}), (2, "w2", {"user": "bob"})]


async def test_metadata_survives_eviction_of_a_suspended_turn() -> None:
    seen: list[ToolContext] = []
    model = ScriptedModel([[Call("approve", {"what": "refund"}, id="a1")],
                           [Call("whoami", {}, id="w1")], [Text("refunded")]])
    async with Runtime("sqlite://", model=model,
                       agent=AgentConfig(tools=[APPROVE, whoami(seen)])) as rt:
        first = await rt.send("c", "refund me", metadata={"user": "alice"})
        assert isinstance(await first.result(), Suspended)
        await anyio.wait_all_tasks_blocked()
        assert await rt.admin.evict("c")
        assert rt._registry.get("c") is None
        cont = await rt.resolve("c", "a1", "approved")
        assert cont is not None and (await cont.result()).text == "refunded"
    assert [dict(c.metadata) for c in seen] == [{"user": "alice"}]


async def test_a_postponed_turn_has_its_own_message_metadata() -> None:
    seen: list[ToolContext] = []
    model = WhoAmIModel()
    async with Runtime("sqlite://", model=model,
                       agent=AgentConfig(tools=[whoami(seen)])) as rt:
        first = await rt.send("c", "hold on", metadata={"user": "ann"})
        await model.held.wait()
        second = await rt.send("c", "me next", metadata={"user": "ben"})
        third = await rt.send("c", "and nobody")
        assert second.postponed and third.postponed
        model.gate.set()
        assert [(await t.result()).text for t in (first, second, third)] == ["ann", "ben", "None"]
    assert [(c.turn, dict(c.metadata)) for c in seen] == [
        (1, {"user": "ann"}), (2, {"user": "ben"}), (3, {})]


async def test_a_conversation_queued_for_a_slot_keeps_its_metadata() -> None:
    seen: list[ToolContext] = []
    model = WhoAmIModel()
    async with Runtime("sqlite://", model=model, config=RuntimeConfig(max_live_agents=1),
                       agent=AgentConfig(tools=[whoami(seen)])) as rt:
        busy = await rt.send("a", "hold the only slot", metadata={"user": "ann"})
        await model.held.wait()
        queued = await rt.send("b", "waiting", metadata={"user": "ben"})
        assert queued.postponed and (await rt.admin.stats()).queued == 1
        model.gate.set()
        assert (await busy.result()).text == "ann"
        assert (await queued.result()).text == "ben"
    assert {(c.conversation_id, c.metadata["user"]) for c in seen} == {("a", "ann"), ("b", "ben")}


def deep(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"k": value}
    return value


@pytest.mark.parametrize("bad", [
    "user=alice",
    {1: "x"},
    {"user": {"id": 1, 2: "x"}},
    {"when": datetime(2024, 1, 1)},
    {"tags": {"a", "b"}},
    {"score": math.nan},
    {"bytes": b"x"},
    {"nul": "a\x00b"},
    {"half": "\ud800"},
    {"big": 1 << 70},
    deep(9),
    {"pad": "x" * (MAX_METADATA_BYTES - 9)},  # {"pad":"…"} is 10 bytes more: 4097
])
async def test_metadata_the_log_cannot_hold_is_refused_before_anything_is_written(
    bad: Any,
) -> None:
    async with Runtime("sqlite://", model=ScriptedModel(["unused"])) as rt:
        with pytest.raises(InvalidInput) as info:
            await rt.send("c", "hi", metadata=bad)
        assert info.value.what.startswith("metadata")
        assert await rt.store.head("c") is None


async def test_metadata_at_the_bounds_is_logged() -> None:
    largest = {"pad": "x" * (MAX_METADATA_BYTES - 10)}
    assert len(msgspec.json.encode(largest)) == MAX_METADATA_BYTES
    async with Runtime("sqlite://", model=ScriptedModel(["ok", "ok"])) as rt:
        for metadata in (largest, deep(8)):
            await (await rt.send("c", "hi", metadata=metadata)).result()
        logged = [e.body.metadata for e in reversed(await rt.history("c"))
                  if isinstance(e.body, UserMessage)]
    assert logged == [largest, deep(8)]


async def test_a_keyed_retry_must_repeat_the_metadata() -> None:
    async with Runtime("sqlite://", model=ScriptedModel(["one"])) as rt:
        first = await rt.send("c", "hi", key="k1", metadata={"user": "alice"})
        await first.result()
        again = await rt.send("c", "hi", key="k1", metadata={"user": "alice"})
        assert again.number == first.number and (await again.result()).text == "one"
        with pytest.raises(IdempotencyConflict):
            await rt.send("c", "hi", key="k1", metadata={"user": "bob"})
        with pytest.raises(IdempotencyConflict):
            await rt.send("c", "hi", key="k1")
        assert await rt.store.head("c") == 1


def test_a_message_without_metadata_is_the_row_it_always_was() -> None:
    assert encode_body(UserMessage("hi")) == msgspec.msgpack.encode({"type": "user", "text": "hi"})
    assert encode_body(UserMessage("hi", None)) == encode_body(UserMessage("hi"))


async def test_a_turns_metadata_is_read_from_the_log_once_folded_out_of_the_working_set(
) -> None:
    async with SQLiteStore(None) as store:
        await store.append("c", [UserMessage("first", {"user": "ann"})], turn=1)
        # a long turn 1: more than a page of events after its message
        await store.append("c", [AssistantMessage("step")] * 300, turn=1)
        await store.append("c", [UserMessage("second", {"user": "ben"})], turn=2)
        await store.append("c", [AssistantMessage("late answer of 1")], turn=1)
        log = await store.read_since("c", 0)
        tail = log[-3:]  # what a working set holds after a fold: turn 1's message is gone
        assert await turn_metadata(store, "c", 1, tail) == {"user": "ann"}
        assert await turn_metadata(store, "c", 2, tail) == {"user": "ben"}
        assert await turn_metadata(store, "c", 1, ()) == {"user": "ann"}
        assert await turn_metadata(store, "c", 3, tail) is None


def test_a_working_sets_byte_estimate_counts_the_metadata() -> None:
    from torpor.compaction.footprint import event_bytes
    from torpor.events import Event

    plain = Event("c", 0, 1, 5, 0, UserMessage("hi"))
    tagged = Event("c", 0, 1, 5, 0, UserMessage("hi", {"user": "x" * 1000}))
    assert event_bytes(tagged) >= event_bytes(plain) + 1000
