"""ModelSummarizer: a model's handoff at each fold, beside the markers, audited, never fatal."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest
from providers import OPENAI
from replay import Recorded, ReplayServer, Reply

from torpor import (
    AgentConfig,
    ConfigError,
    EchoModel,
    InvalidInput,
    ModelError,
    ModelOverloaded,
    ModelSummarizer,
    Runtime,
    ScriptedModel,
    TurnAborted,
)
from torpor.compaction import handoff_text
from torpor.compaction.markers import HANDOFF_HEADER
from torpor.events import Event, UserMessage
from torpor.llm import Fail, Report, Signal, Text, Wait
from torpor.llm.protocol import ContextMessage, SystemMessage
from torpor.memory.bundle import BUNDLE_HEADER

SMALL = dict(working_budget=150, tail_turns=1, context_window=4_000, max_output_tokens=500,
             safety_margin=100, recall_tools=False)
SUMMARY = "EPISODE:\nThe user listed build ids.\n\nFACTS:\n- build-0001 is the release build"


def long_message(i: int) -> str:
    return f"note {i}: build-{i:04d} " + " ".join(f"detail{j}" for j in range(25))


async def converse(rt: Runtime, turns: int, conversation: str = "c") -> None:
    for i in range(turns):
        await (await rt.send(conversation, long_message(i))).result()


def handoffs(model: ScriptedModel | EchoModel) -> list[str]:
    calls: list[list[ContextMessage]] = getattr(model, "calls", [])
    return [m.text for call in calls for m in call[1:2] if isinstance(m, SystemMessage)]


async def test_a_fold_stores_the_models_summary_beside_the_markers() -> None:
    summarizer_model = ScriptedModel(
        [[Text(SUMMARY), Report(prompt_tokens=420, completion_tokens=30, cache_read_tokens=0)]],
        name="summarizer", loop=True)
    conversation_model = ScriptedModel([[Text("ok")]], loop=True)
    agent = AgentConfig(model=conversation_model, summarizer=ModelSummarizer(summarizer_model),
                        **SMALL)
    async with Runtime("sqlite://", agent=agent) as rt:
        await converse(rt, 6)
        checkpoints = await rt.store.checkpoints("c")
        calls = await rt.store.model_calls("c", limit=100)
    assert len(checkpoints) >= 2 and all(cp.summary == SUMMARY for cp in checkpoints)
    assert all(cp.markers for cp in checkpoints)  # the summary never replaces the recall path
    # What the conversation's model saw after the first fold: the memory bundle (the span's
    # episode; this answer has no ITEMS list, so no facts), then the markers.
    seen = [h for h in handoffs(conversation_model) if h.startswith(BUNDLE_HEADER)]
    assert seen and "[events 0\u2013" in seen[0]
    assert "The user listed build ids." in seen[0] and SUMMARY not in seen[0]
    assert seen[0].index("The user listed") < seen[0].index(HANDOFF_HEADER)
    assert seen[0] == handoff_text(checkpoints[0])
    summaries = [c for c in calls if c.purpose == "summary"]
    assert len(summaries) == len(checkpoints)
    first = summaries[0]
    assert first.model == "summarizer" and first.error is None
    assert first.reported_prompt_tokens == 420 and first.completion_tokens == 30
    assert first.compaction_cycle == checkpoints[0].cycle == 1
    assert set(first.sections) == {"system", "transcript"}
    assert all(c.purpose == "turn" for c in calls if c not in summaries)
    # The summarizer saw its instructions, the previous summary and the folded events.
    prompts = summarizer_model.calls
    system, body = prompts[0][0], prompts[0][1]
    assert isinstance(system, SystemMessage) and "FACTS:" in system.text
    assert isinstance(body, UserMessage) and "Previous summary:\n(none)" in body.text
    assert "[0] user: note 0: build-0000" in body.text and "[1] assistant: ok" in body.text
    assert SUMMARY in prompts[1][1].text  # the second fold merges the first summary


async def test_the_admin_rebuilds_turn_calls_and_refuses_summary_calls() -> None:
    summarizer = ModelSummarizer(ScriptedModel([[Text(SUMMARY)]], loop=True))
    agent = AgentConfig(model=EchoModel(), summarizer=summarizer, **SMALL)
    async with Runtime("sqlite://", agent=agent) as rt:
        await converse(rt, 4)
        calls = await rt.store.model_calls("c", limit=100)
        index = next(i for i, c in enumerate(calls) if c.purpose == "summary")
        with pytest.raises(InvalidInput, match="'summary' call"):
            await rt.admin.rendered("c", index)
        for n, call in enumerate(calls):
            if call.purpose == "turn":  # every call that answered rebuilds to its hash
                assert (await rt.admin.rendered("c", n)).matches


async def test_a_failing_summarizer_leaves_a_marker_only_checkpoint_not_a_failed_turn() -> None:
    summarizer_model = ScriptedModel([
        [Fail(ModelOverloaded("anthropic: Overloaded", provider="anthropic"))],
        [Text(SUMMARY)],
        [Text("partial"), Fail(RuntimeError("socket gone"))],
    ], name="summarizer")
    agent = AgentConfig(model=EchoModel(), summarizer=ModelSummarizer(summarizer_model), **SMALL)
    async with Runtime("sqlite://", agent=agent) as rt:
        await converse(rt, 8)  # every turn answered despite the failures
        checkpoints = await rt.store.checkpoints("c")
        calls = [c for c in await rt.store.model_calls("c", limit=100) if c.purpose == "summary"]
        history = await rt.history("c", limit=100)
    assert len(history) == 16 and len(checkpoints) >= 3
    first, second, third = checkpoints[:3]
    assert first.summary == "" and first.markers  # marker-only handoff for that span
    assert second.summary == SUMMARY
    assert third.summary == SUMMARY and third.markers  # the previous summary carried over
    assert calls[0].error is not None and calls[0].error.startswith("ModelOverloaded:")
    assert calls[1].error is None
    assert calls[2].error is not None and "socket gone" in calls[2].error


async def test_the_output_and_the_input_are_bounded() -> None:
    words = " ".join(f"word{i}" for i in range(3_000))
    model = ScriptedModel([[Text(words[:500]), Text(words[500:])]])
    summarizer = ModelSummarizer(model, max_output_tokens=40, max_input_tokens=400)
    events = [Event("c", i, 1 + i // 2, 300, 0, UserMessage(long_message(i) * 5))
              for i in range(40)]
    outcome = await summarizer.run("an earlier summary", events)
    assert outcome.error is None and outcome.text.endswith("[…]")
    assert len(outcome.text.split()) < 60
    prompt = model.calls[0][1]
    assert isinstance(prompt, UserMessage)
    assert "earlier events left out for length" in prompt.text
    assert "[39] user: note 39" in prompt.text  # the newest events are kept (here in part)
    assert outcome.estimated_tokens <= 400 + 8  # the bound, plus two messages' framing
    assert outcome.start == 0 and outcome.end == 39


async def test_the_summarizer_protocol_method_raises_on_failure() -> None:
    summarizer = ModelSummarizer(ScriptedModel([[Fail(ModelOverloaded("busy"))], [Text("")]]))
    events = [Event("c", 0, 1, 5, 0, UserMessage("hello"))]
    with pytest.raises(ModelError, match="busy"):
        await summarizer.summarize("", events)
    with pytest.raises(ModelError, match="no text"):
        await summarizer.summarize("", events)


async def test_a_slow_summarizer_times_out_into_a_marker_only_handoff() -> None:
    never = anyio.Event()
    summarizer = ModelSummarizer(ScriptedModel([[Text("EPI"), Wait(never)]]), timeout=0.05)
    outcome = await summarizer.run("", [Event("c", 0, 1, 5, 0, UserMessage("hello"))])
    assert outcome.text == "" and outcome.error is not None
    assert outcome.error.startswith("ModelTimeout:")


async def first_of(*waits: Callable[[], Awaitable[object]]) -> None:
    """Return as soon as one of ``waits`` has returned (the others are cancelled)."""
    async with anyio.create_task_group() as tg:
        async def run(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            tg.cancel_scope.cancel()

        for wait in waits:
            tg.start_soon(run, wait)


async def test_a_cancel_during_the_summary_call_cancels_the_turn() -> None:
    reached, never = anyio.Event(), anyio.Event()
    summarizer_model = ScriptedModel([[Signal(reached), Wait(never)]], name="summarizer")
    agent = AgentConfig(model=EchoModel(), summarizer=ModelSummarizer(summarizer_model), **SMALL)
    async with Runtime("sqlite://", agent=agent) as rt:
        for i in range(10):  # until a turn starts with a fold
            turn = await rt.send("c", long_message(i))
            with anyio.fail_after(10):
                await first_of(turn.result, reached.wait)
            if reached.is_set():
                break
        assert reached.is_set()
        assert await rt.cancel("c") is True  # the summary's model call is cancelled at once
        with pytest.raises(TurnAborted) as info:
            await turn.result()
        assert info.value.reason == "cancelled"
        assert await rt.store.checkpoints("c") == []  # the fold did not happen


async def test_a_summarizer_over_real_http() -> None:
    def reply(request: Recorded) -> Reply:
        system = request.json()["messages"][0]["content"]
        if "FACTS:" in system:  # the summarizer's own call
            return OPENAI.text([SUMMARY[:20], SUMMARY[20:]], usage=(300, 25, 256, 0))
        return OPENAI.text(["ok"])

    async with ReplayServer(default=reply) as server:
        model = OPENAI.model(server)
        agent = AgentConfig(model=model, summarizer=ModelSummarizer(model), **SMALL)
        async with Runtime("sqlite://", agent=agent) as rt:
            await converse(rt, 4)
            checkpoints = await rt.store.checkpoints("c")
            calls = await rt.store.model_calls("c", limit=100)
    assert checkpoints[0].summary == SUMMARY
    summary_call = next(c for c in calls if c.purpose == "summary")
    assert summary_call.cache_read_tokens == 256 and summary_call.model == "openai:gpt-test"


def test_summarizer_settings_are_checked() -> None:
    model = EchoModel()
    for bad in (dict(max_output_tokens=0), dict(max_input_tokens=10), dict(timeout=0),
                dict(instructions=" ")):
        with pytest.raises(ConfigError):
            ModelSummarizer(model, **bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        ModelSummarizer("gpt-4o")  # type: ignore[arg-type]


def test_agent_config_takes_a_model_and_refuses_what_is_not_one() -> None:
    model = EchoModel()
    assert AgentConfig(model=model).model is model
    for bad in ("gpt-4o", 5, object()):
        with pytest.raises(ConfigError) as info:
            AgentConfig(model=bad)
        assert info.value.field == "model"
