"""The task card: set from code or by the model, logged, never folded, rebuilt exactly.

Every card change is a TaskCard event in the log; the card in effect is rendered
right after the system prompt on every call, across folds, revivals and on both
backends; the audit rebuilds each call with the card it was sent; a change made
mid-turn is in effect from the turn's next model call; a card over its budget is
refused whole, with nothing logged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from store_backends import Backend
from support import writes_fail, writes_succeed

import torpor
from torpor import AgentConfig, Runtime, ScriptedModel, TaskCard, TaskCardTooLarge
from torpor.compaction.task_card import card_text
from torpor.llm import Call, Text
from torpor.llm.protocol import SystemMessage

SMALL = AgentConfig(working_budget=300, tail_turns=2, context_window=4_000,
                    max_output_tokens=500, safety_margin=100, system_prompt="be brief")


def url_of(backend: Backend) -> str:
    return f"sqlite:///{backend.location}" if backend.name == "sqlite" else str(backend.location)


def second_system(context: list[object]) -> str:
    """The text of the block right after the system prompt."""
    assert isinstance(context[0], SystemMessage) and context[0].text == "be brief"
    block = context[1]
    assert isinstance(block, SystemMessage)
    return block.text


async def test_a_card_set_from_code_is_logged_rendered_after_the_prompt_and_survives_folds(
    backend: Backend,
) -> None:
    model = ScriptedModel.replies("ok", loop=True)
    async with Runtime(url_of(backend), model=model, agent=SMALL) as rt:
        card = await rt.task("c").update(
            goal="ship the OPS-77 fix", constraints=["no downtime"], key_positions=[0]
        )
        assert card == TaskCard("ship the OPS-77 fix", ("no downtime",), (), (0,), "code")
        assert await rt.task("c").get() == card
        for i in range(30):
            await (await rt.send("c", f"message {i} " + "words " * 30)).result()
        calls = await rt.store.model_calls("c", limit=1_000)
        assert calls[-1].compaction_cycle >= 2  # folded, more than once
        for context in model.calls:
            assert second_system(context) == card_text(card)
        logged = [e for e in await rt.history("c", limit=10_000) if e.kind == "task_card"]
        assert [e.body for e in logged] == [card]
        sections = calls[-1].sections
        assert sections["task_card"] > 0
        rebuilt = await rt.admin.rendered("c", -1)
        assert rebuilt.matches

    # Another process: the card is found in the latest fold (its event is long folded).
    model2 = ScriptedModel.replies("again")
    async with Runtime(url_of(backend), model=model2, agent=SMALL) as rt:
        assert await rt.task("c").get() == card  # read from the log, not by reviving
        await (await rt.send("c", "and now?")).result()
        assert second_system(model2.calls[0]) == card_text(card)
        assert (await rt.admin.rendered("c", -1)).matches


async def test_the_model_changes_the_card_mid_turn_and_the_next_call_sees_it() -> None:
    config = AgentConfig(task_card_tool=True, system_prompt="be brief")
    model = ScriptedModel([
        [Call("task_card", {"goal": "find the leak", "open_loops": ["check pool size"]})],
        [Text("noted")],
    ])
    async with Runtime("sqlite://", model=model, agent=config) as rt:
        await rt.task("c").update(goal="first goal")
        await (await rt.send("c", "go")).result()
        first, second = model.calls
        assert "first goal" in second_system(first)
        assert "task_card" in {spec.name for spec in model.tool_specs[0]}
        card = await rt.task("c").get()
        assert card == TaskCard("find the leak", (), ("check pool size",), (), "model")
        assert second_system(second) == card_text(card)
        assert (await rt.admin.rendered("c", 0)).matches  # each call with its own card
        assert (await rt.admin.rendered("c", 1)).matches


@torpor.tool
async def note(topic: str) -> str:
    """Records a topic (and, in this test, changes the task card from code mid-turn)."""
    await RUNTIME[0].task("c").update(open_loops=[topic])
    return "noted"


RUNTIME: list[Runtime] = []


async def test_a_change_from_code_during_a_turn_takes_effect_at_the_next_model_call() -> None:
    model = ScriptedModel([[Call("note", {"topic": "rotate keys"})], [Text("done")]])
    config = AgentConfig(tools=[note], system_prompt="be brief")
    async with Runtime("sqlite://", model=model, agent=config) as rt:
        RUNTIME[:] = [rt]
        await rt.task("c").update(goal="harden the service")
        await (await rt.send("c", "start")).result()
        first, second = model.calls
        assert "rotate keys" not in second_system(first)
        assert "Open loops:\n- rotate keys" in second_system(second)
        assert "harden the service" in second_system(second)  # merged, not replaced
        kinds = [e.kind for e in reversed(await rt.history("c"))]
        # logged while the tool ran: between the call and its result
        assert kinds == ["task_card", "user", "assistant", "task_card", "tool_result",
                         "assistant"]
        assert (await rt.admin.rendered("c", 1)).matches


async def test_a_card_over_its_budget_is_refused_whole_and_nothing_is_logged() -> None:
    config = AgentConfig(task_card_tokens=40, task_card_tool=True)
    model = ScriptedModel([[Call("task_card", {"constraints": ["rule " * 80]})], [Text("ok")]])
    async with Runtime("sqlite://", model=model, agent=config) as rt:
        await rt.task("c").update(goal="small")
        with pytest.raises(TaskCardTooLarge) as info:
            await rt.task("c").update(constraints=["word " * 100])
        assert info.value.budget == 40 and info.value.tokens > 40
        with pytest.raises(torpor.InvalidInput):
            await rt.task("c").update(key_positions=[-1])
        with pytest.raises(torpor.InvalidInput):
            await rt.task("c").update(constraints="not a list")  # type: ignore[arg-type]
        assert await rt.store.head("c") == 0  # only the first card
        await (await rt.send("c", "go")).result()
        result = next(e.body for e in await rt.history("c") if e.kind == "tool_result")
        assert isinstance(result, torpor.ToolResult) and result.is_error
        assert "task_card_tokens" in result.content
        assert await rt.task("c").get() == TaskCard(goal="small")


async def test_an_evicted_agent_revives_to_log_a_card_and_a_hibernated_one_keeps_it(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    model = ScriptedModel.replies("a", "b", "c")
    async with Runtime(url, model=model, agent=SMALL) as rt:
        await (await rt.send("c", "hello")).result()
        await rt.admin.evict("c")
        await rt.task("c").update(goal="after eviction")  # through the actor's mailbox
        await (await rt.send("c", "next")).result()
        assert "after eviction" in second_system(model.calls[-1])
        await rt.admin.hibernate("c")
        await rt.task("c").update(goal="after hibernation")
        await (await rt.send("c", "last")).result()
        assert "after hibernation" in second_system(model.calls[-1])
        assert [c.matches for c in [await rt.admin.rendered("c", i) for i in range(3)]] == [
            True, True, True,
        ]


@torpor.tool
async def loop_note(topic: str) -> str:
    """Adds an open loop from code while the model's own card change runs beside it."""
    await RUNTIME[0].task("c").update(open_loops=[topic])
    return "noted"


async def test_a_change_from_code_and_one_from_the_model_at_once_are_both_kept() -> None:
    # One step with two calls: the built-in card tool and a tool changing the card from
    # code run concurrently; each merges under the append lock, so neither is lost.
    model = ScriptedModel([
        [Call("task_card", {"goal": "goal from the model"}), Call("loop_note", {"topic": "T"})],
        [Text("done")],
    ])
    config = AgentConfig(tools=[loop_note], task_card_tool=True, system_prompt="be brief")
    async with Runtime("sqlite://", model=model, agent=config) as rt:
        RUNTIME[:] = [rt]
        await (await rt.send("c", "start")).result()
        card = await rt.task("c").get()
        assert card is not None
        assert (card.goal, card.open_loops) == ("goal from the model", ("T",))
        cards = [e.body for e in reversed(await rt.history("c")) if e.kind == "task_card"]
        assert len(cards) == 2 and cards[-1] == card


async def test_a_store_that_cannot_write_refuses_the_change_and_loses_nothing(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'full.db'}"
    async with Runtime(url, model=ScriptedModel.replies("ok"), agent=SMALL) as rt:
        await rt.task("c").update(goal="kept")
        await writes_fail(rt.store)
        with pytest.raises(torpor.StoreUnavailable):
            await rt.task("c").update(goal="lost " * 100)  # larger than any room left
        await writes_succeed(rt.store)
        assert await rt.task("c").get() == TaskCard(goal="kept")
        await rt.task("c").update(open_loops=["after recovery"])
        assert await rt.task("c").get() == TaskCard("kept", (), ("after recovery",))
        assert [e.kind for e in await rt.history("c")] == ["task_card", "task_card"]
