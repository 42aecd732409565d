"""Compaction inside the runtime: folds, recall as an API and as a tool, audit, calibration."""

from __future__ import annotations

import pytest

import torpor
from torpor import AgentConfig, ConfigError, EchoModel, Runtime, RuntimeConfig, ScriptedModel
from torpor.llm import Call, Report, Text

SMALL = AgentConfig(working_budget=300, tail_turns=2, context_window=4_000,
                    max_output_tokens=500, safety_margin=100)


async def test_long_conversations_fold_and_stay_recallable() -> None:
    async with Runtime("sqlite://", model=EchoModel(), agent=SMALL) as rt:
        for i in range(30):
            words = " ".join(f"filler{j}" for j in range(20))
            await (await rt.send("c", f"note {i}: build-{i:04d}-hash {words}")).result()
        checkpoints = await rt.store.checkpoints("c")
        assert len(checkpoints) >= 2
        assert [cp.cycle for cp in checkpoints] == list(range(1, len(checkpoints) + 1))
        info = await rt.admin.inspect("c")
        assert info.checkpoint_position == checkpoints[-1].position
        assert info.working_set_tokens <= SMALL.working_budget + 200
        # Nothing was deleted: the full log is still there, and old content is findable.
        assert len(await rt.history("c", limit=1000)) == 60
        hits = await rt.recall("c", "build-0003-hash")
        assert hits and hits[0].position in (6, 7)
        exact = await rt.expand("c", hits[0].position, hits[0].position)
        assert "build-0003-hash" in str(exact[0].body)
        # Every model call rebuilds from its recipe to the same hash.
        calls = await rt.store.model_calls("c", limit=100)
        assert calls[-1].compaction_cycle == len(checkpoints)
        for n in (0, 10, -1):
            assert (await rt.admin.rendered("c", n)).matches


async def test_the_model_can_call_recall_and_expand_as_tools() -> None:
    model = ScriptedModel([
        [Text("noted")],
        [Call("recall", {"query": "zebra-7731"}, id="r1")],
        [Call("expand", {"start": 0, "end": 0}, id="e1")],
        [Text("found it")],
    ])
    async with Runtime("sqlite://", model=model) as rt:
        await (await rt.send("c", "remember the code zebra-7731")).result()
        final = await (await rt.send("c", "what was the code?")).result()
        assert final.text == "found it"
        results = {e.body.call_id: e.body for e in await rt.history("c", limit=100)
                   if isinstance(e.body, torpor.ToolResult)}
        assert not results["r1"].is_error and "zebra-7731" in results["r1"].content
        assert not results["e1"].is_error and "zebra-7731" in results["e1"].content
        specs = {spec.name for spec in model.tool_specs[0]}
        assert {"recall", "expand"} <= specs


async def test_reported_prompt_tokens_over_the_trigger_request_a_fold() -> None:
    config = AgentConfig(context_window=10_000, max_output_tokens=1_000, safety_margin=0,
                         working_budget=7_000, tail_turns=1)
    steps = [[Text(f"a{i}")] for i in range(4)]
    steps.append([Text("big"), Report(prompt_tokens=8_500, completion_tokens=1)])
    steps.append([Text("after")])
    async with Runtime("sqlite://", model=ScriptedModel(steps), agent=config) as rt:
        for i in range(5):
            await (await rt.send("c", f"short {i}")).result()
        assert await rt.store.checkpoints("c") == []  # far under the working budget
        await (await rt.send("c", "next")).result()
        checkpoints = await rt.store.checkpoints("c")
        assert len(checkpoints) == 1  # the provider's count asked for it
        calls = await rt.store.model_calls("c", limit=10)
        assert calls[4].reported_prompt_tokens == 8_500
        assert calls[5].compaction_cycle == 1


async def test_a_provider_counting_more_than_the_estimate_calibrates_the_next_fold() -> None:
    """The provider's count, under the trigger, still scales our estimate: a tail our own
    count puts well inside the working budget folds once the model has said it counts
    four times more. Without the calibration nothing here would fold."""
    config = AgentConfig(context_window=10_000, max_output_tokens=1_000, safety_margin=0,
                         working_budget=3_000, tail_turns=1)
    reported = 7_000  # under the trigger (0.8 * 9,000): no fold is asked for outright
    words = " ".join(f"word{j}" for j in range(60))
    steps = [[Text(f"a{i}")] for i in range(5)]
    steps.append([Text("counted"), Report(prompt_tokens=reported, completion_tokens=1)])
    steps.append([Text("after")])
    async with Runtime("sqlite://", model=ScriptedModel(steps), agent=config) as rt:
        for i in range(6):
            await (await rt.send("c", f"note {i}: {words}")).result()
        assert await rt.store.checkpoints("c") == []
        calls = await rt.store.model_calls("c", limit=10)
        estimate = calls[5].estimated_prompt_tokens
        # Our own count: far inside the budget; the provider's: four times it or more.
        assert estimate * 2 < config.working_budget and reported >= 4 * estimate
        assert reported < config.compaction_trigger_ratio * 9_000
        await (await rt.send("c", "next")).result()
        assert len(await rt.store.checkpoints("c")) == 1
        calls = await rt.store.model_calls("c", limit=10)
        assert calls[6].compaction_cycle == 1


async def test_memory_budget_hibernates_least_recently_used_agents() -> None:
    config = RuntimeConfig(max_working_set_bytes=1)
    async with Runtime("sqlite://", model=EchoModel(), config=config) as rt:
        for conv in ("a", "b", "c"):
            await (await rt.send(conv, "hello")).result()
        stats = (await rt.admin.stats())
        assert stats.hibernations >= 2
        assert (await rt.admin.stats()).live == 3  # hibernated, not evicted


@pytest.mark.parametrize(
    ("factory", "field"),
    [
        (lambda: RuntimeConfig(hibernate_after=0), "hibernate_after"),
        (lambda: RuntimeConfig(hibernate_after=10, evict_after=5), "evict_after"),
        (lambda: RuntimeConfig(mailbox_bound=0), "mailbox_bound"),
        (lambda: RuntimeConfig(max_restarts=-1), "max_restarts"),
        (lambda: AgentConfig(max_steps=0), "max_steps"),
        (lambda: AgentConfig(working_budget=-5), "working_budget"),
        (lambda: AgentConfig(hard_ceiling_ratio=1.5), "hard_ceiling_ratio"),
        (lambda: AgentConfig(context_window=1_000, max_output_tokens=2_000), "max_output_tokens"),
    ],
)
def test_invalid_configuration_fails_at_construction_naming_the_field(
    factory: object, field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        factory()  # type: ignore[operator]
    assert info.value.field == field
    assert field in str(info.value)
