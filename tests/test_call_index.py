"""A turn's model calls keep counting across a suspension: the audit's call_index and max_steps.

One turn that suspends on an outside approval is still one turn: the model call
after the answer is the turn's second (``call_index`` 2 in the audit and in
``/admin/calls``), whether the agent stayed in memory, hibernated or was
evicted while it waited, and ``max_steps`` counts the calls on both sides.
"""

from __future__ import annotations

import anyio
import pytest

from torpor import AgentConfig, ExternalTool, Runtime, ScriptedModel, TurnAborted
from torpor.llm import Call, Text

APPROVE = ExternalTool("approve", "Ask a human to approve", {
    "type": "object", "properties": {"what": {"type": "string"}}, "required": ["what"]})


def approval_model() -> ScriptedModel:
    return ScriptedModel([[Text("asking"), Call("approve", {"what": "deploy"}, id="c1")],
                          [Text("deployed")]])


async def suspend_then_resolve(rt: Runtime, between: str) -> None:
    """One turn: a call that suspends, ``between`` (stay / hibernate / evict), the answer."""
    first = await (await rt.send("c", "deploy please")).result()
    assert first.call_ids == ("c1",)  # type: ignore[union-attr]  # a Suspended
    await anyio.wait_all_tasks_blocked()
    if between == "hibernate":
        assert await rt.admin.hibernate("c")
    elif between == "evict":
        assert await rt.admin.evict("c")
        assert rt._registry.get("c") is None  # the revival reads the count from the log
    continuation = await rt.resolve("c", "c1", "approved")
    assert continuation is not None
    assert (await continuation.result()).text == "deployed"  # type: ignore[union-attr]


@pytest.mark.parametrize("between", ["stay", "hibernate", "evict"])
async def test_the_call_after_an_approval_is_the_turns_second(between: str) -> None:
    async with Runtime("sqlite://", model=approval_model(),
                       agent=AgentConfig(tools=[APPROVE])) as rt:
        await suspend_then_resolve(rt, between)
        calls = sorted(await rt.store.model_calls("c"), key=lambda c: c.created_at)
        assert [(c.turn, c.call_index) for c in calls] == [(1, 1), (1, 2)]
        # /admin/calls/c/0 and /1: what an operator reads (newest first, as the store lists)
        shown = [(await rt.admin.rendered("c", n)).call.call_index for n in (0, 1)]
        assert sorted(shown) == [1, 2]


@pytest.mark.parametrize("between", ["stay", "evict"])
async def test_max_steps_counts_the_calls_before_the_suspension(between: str) -> None:
    """Two steps allowed: the call that suspended and the one after it; a third is cut."""
    model = ScriptedModel([
        [Text("asking"), Call("approve", {"what": "deploy"}, id="c1")],
        [Text("again"), Call("approve", {"what": "deploy twice"}, id="c2")],
        [Text("never asked")],
    ])
    async with Runtime("sqlite://", model=model,
                       agent=AgentConfig(tools=[APPROVE], max_steps=2)) as rt:
        await (await rt.send("c", "deploy please")).result()
        await anyio.wait_all_tasks_blocked()
        if between == "evict":
            assert await rt.admin.evict("c")
        second = await rt.resolve("c", "c1", "approved")
        assert second is not None
        assert (await second.result()).call_ids == ("c2",)  # type: ignore[union-attr]
        await anyio.wait_all_tasks_blocked()
        if between == "evict":
            assert await rt.admin.evict("c")
        third = await rt.resolve("c", "c2", "approved")
        assert third is not None
        with pytest.raises(TurnAborted) as aborted:
            await third.result()
        assert aborted.value.reason == "step_limit"
        assert "more than 2 model calls" in aborted.value.detail
        indexes = sorted(c.call_index for c in await rt.store.model_calls("c"))
        assert indexes == [1, 2]  # the third was never asked
        assert len(model.calls) == 2
