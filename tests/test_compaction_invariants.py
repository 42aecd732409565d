"""Budget invariants under hypothesis, in memory and through the real SQLite store.

Whatever the conversation (tiny or giant messages, tool results larger than
the whole budget, unanswered calls, aborts), every rendered context:
starts with the system prompt, stays under the hard ceiling, has no orphaned
tool call or result; folded positions stay reachable; the log is never
rewritten; and the audit recipe rebuilds the exact same context.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torpor.compaction import (
    EXPAND_TOOL,
    MESSAGE_OVERHEAD,
    RECALL_TOOL,
    CompactionPolicy,
    Rendered,
    WorkingSet,
    build_checkpoint,
    count_body,
    count_text,
    expand,
    make_token_counter,
    plan_fold,
    rebuild_rendered,
    recall,
)
from torpor.compaction.render import tools_tokens
from torpor.events import (
    Aborted,
    AssistantMessage,
    Body,
    Event,
    Resolved,
    Suspended,
    ToolCall,
    ToolResult,
    UserMessage,
    encode_body,
)
from torpor.llm.protocol import SystemMessage
from torpor.store import open_store
from torpor.store.protocol import Checkpoint, EventStore

POLICY = CompactionPolicy(
    context_window=4_000,
    max_output_tokens=400,
    safety_margin=100,
    working_budget=1_200,
    tail_turns=2,
    keep_tool_results=2,
    clear_at_least=600,  # stubs in batches: rebuilt from the recipe all the same
    clip_tokens=800,
)
SYSTEM = "You are a careful assistant."
TOOLS = (RECALL_TOOL, EXPAND_TOOL)

sizes = st.sampled_from([1, 3, 10, 40, 150, 600, 1_500, 5_000])
say = st.tuples(st.just("say"), sizes)
tools = st.tuples(
    st.just("tools"),
    st.lists(st.tuples(sizes, st.booleans()), min_size=1, max_size=3),  # (size, answered)
    st.booleans(),  # suspended first (answers arrive after a Resolved)
)
abort = st.tuples(st.just("abort"), st.booleans())
turns = st.lists(
    st.tuples(sizes, st.lists(st.one_of(say, tools, abort), max_size=3)), min_size=1, max_size=9
)


def words(tag: str, n: int) -> str:
    return tag + " " + "lorem " * n


Append = Callable[[Sequence[Body], int], Awaitable[list[Event]]]
OnCheckpoint = Callable[[Checkpoint], Awaitable[None]]


async def simulate(
    scenario: list[Any], append: Append, on_checkpoint: OnCheckpoint
) -> tuple[WorkingSet, list[Rendered]]:
    """Drive a WorkingSet the way an agent does: log, fold if needed, render, repeat."""
    ws = WorkingSet("conv", None, [])
    renders: list[Rendered] = []

    async def log(bodies: Sequence[Body], turn: int) -> None:
        ws.append(await append(bodies, turn))

    async def step() -> None:
        plan = plan_fold(ws, POLICY)
        if plan is not None:
            checkpoint = build_checkpoint(plan, ws.checkpoint, created_at=0)
            await on_checkpoint(checkpoint)
            ws.apply(checkpoint)
        rendered = ws.render(SYSTEM, POLICY, TOOLS)
        check_rendered(rendered, ws)
        renders.append(rendered)

    for turn, (user_size, steps) in enumerate(scenario, start=1):
        await log([UserMessage(words(f"usr{turn}x", user_size))], turn)
        await step()
        for k, action in enumerate(steps):
            if action[0] == "say":
                await log([AssistantMessage(words(f"asst{turn}x{k}", action[1]))], turn)
            elif action[0] == "abort":
                partial = words(f"part{turn}x{k}", 5) if action[1] else ""
                await log([Aborted("cancelled", partial_text=partial)], turn)
            else:
                _, results, suspended = action
                calls = tuple(
                    ToolCall(f"c{turn}_{k}_{i}", "fetch", {"i": i}) for i in range(len(results))
                )
                await log([AssistantMessage("", calls)], turn)
                if suspended:
                    await log([Suspended(tuple(c.id for c in calls))], turn)
                for call, (size, answered) in zip(calls, results, strict=True):
                    if answered:
                        result = ToolResult(call.id, "fetch", words(f"res{turn}x{k}", size))
                        bodies: list[Body] = [Resolved(call.id), result] if suspended else [result]
                        await log(bodies, turn)
            await step()
    return ws, renders


_deterministic = msgspec.msgpack.Encoder(order="deterministic")


def whole_hash(messages: Sequence[object], tools: Sequence[object]) -> str:
    """Recipe version 1's hash, computed here from its definition: one sha256 of it all."""
    return hashlib.sha256(_deterministic.encode((messages, tuple(tools)))).hexdigest()


def chain_hash(messages: Sequence[object], tools: Sequence[object]) -> str:
    """Recipe version 2's hash, from its definition: a chain over the messages."""
    state = hashlib.sha256(b"torpor rendered context, hash chain v2").digest()
    for message in messages:
        state = hashlib.sha256(state + _deterministic.encode(message)).digest()
    tail = hashlib.sha256(_deterministic.encode(tuple(tools))).digest()
    return hashlib.sha256(state + tail).hexdigest()


def message_tokens(message: object) -> int:
    if isinstance(message, SystemMessage | UserMessage):
        return count_text(message.text) + MESSAGE_OVERHEAD
    if isinstance(message, ToolResult):
        return count_text(message.content) + MESSAGE_OVERHEAD
    assert isinstance(message, AssistantMessage)
    return count_body(message)


def check_rendered(rendered: Rendered, ws: WorkingSet) -> None:
    messages = rendered.messages
    assert messages[0] == SystemMessage(SYSTEM)
    assert rendered.estimated_tokens <= POLICY.effective_ceiling
    actual = sum(message_tokens(m) for m in messages) + tools_tokens(TOOLS, POLICY.encoding)
    assert actual <= POLICY.effective_ceiling
    open_calls: set[str] = set()
    for message in messages[1:]:
        if isinstance(message, ToolResult):
            assert message.call_id in open_calls
            open_calls.discard(message.call_id)
            continue
        assert not open_calls
        if isinstance(message, AssistantMessage):
            open_calls = {c.id for c in message.tool_calls}
        else:
            assert not isinstance(message, SystemMessage) or message is messages[1]
    assert not open_calls
    assert ws.tail_tokens == sum(e.tokens for e in ws.tail)
    checkpoint = ws.checkpoint
    if checkpoint is not None:
        covered = [p for m in checkpoint.markers for p in range(m.start, m.end + 1)]
        assert covered == list(range(checkpoint.position))
        assert not ws.tail or ws.tail[0].position >= checkpoint.position


def memory_log() -> tuple[Append, list[Event]]:
    events: list[Event] = []

    async def append(bodies: Sequence[Body], turn: int) -> list[Event]:
        out = []
        for body in bodies:
            event = Event("conv", len(events), turn, count_body(body), len(events) * 1000, body)
            events.append(event)
            out.append(event)
        return out

    return append, events


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns)
def test_rendered_context_invariants_in_memory(scenario: list[Any]) -> None:
    append, events = memory_log()
    checkpoints: list[Checkpoint] = []

    async def keep(checkpoint: Checkpoint) -> None:
        checkpoints.append(checkpoint)

    ws, renders = asyncio.run(simulate(scenario, append, keep))
    assert renders
    for older, newer in itertools.pairwise(checkpoints):
        assert newer.cycle == older.cycle + 1 and newer.position > older.position
    # Revival from (latest checkpoint, events since) renders the very same bytes.
    revived = WorkingSet("conv", ws.checkpoint, events)
    assert revived.render(SYSTEM, POLICY, TOOLS).hash == renders[-1].hash


async def _through_store(scenario: list[Any]) -> list[Checkpoint]:
    async with open_store("sqlite://", token_counter=make_token_counter()) as store:
        checkpoints: list[Checkpoint] = []
        appended: list[Event] = []

        async def append(bodies: Sequence[Body], turn: int) -> list[Event]:
            events: list[Event] = await store.append_events("conv", bodies, turn=turn)
            appended.extend(events)
            return events

        async def keep(checkpoint: Checkpoint) -> None:
            await store.put_checkpoint(checkpoint)
            checkpoints.append(checkpoint)

        ws, renders = await simulate(scenario, append, keep)

        # Folding deleted and rewrote nothing: the log is exactly what was appended.
        logged = await store.read_since("conv", 0)
        assert [(e.position, e.turn, e.tokens, e.created_at) for e in logged] == [
            (e.position, e.turn, e.tokens, e.created_at) for e in appended
        ]
        assert [encode_body(e.body) for e in logged] == [encode_body(e.body) for e in appended]

        # The audit recipe of every render rebuilds the same payload from the log, and a
        # recipe recorded before the hash chain (version 1) still verifies, by its own hash.
        for rendered in renders:
            rebuilt = await rebuild_rendered(store, "conv", rendered.recipe, SYSTEM, POLICY, TOOLS)
            assert rebuilt.hash == rendered.hash == chain_hash(rendered.messages, TOOLS)
            assert rebuilt.sections == rendered.sections
            old = msgspec.structs.replace(rendered.recipe, version=1)
            rebuilt = await rebuild_rendered(store, "conv", old, SYSTEM, POLICY, TOOLS)
            assert rebuilt.hash == whole_hash(rebuilt.messages, TOOLS)
            assert rebuilt.recipe == old and len(rebuilt.messages) == len(rendered.messages)
            for then, now in zip(rebuilt.messages, rendered.messages, strict=True):
                # the same messages, but stubs in the wording of the calls that recipe recorded
                assert then == now or ("elided; expand(" in str(then) and "elided: " in str(now))

        # Every folded position is reachable: by expand always, by recall for messages.
        await check_reachable(store, ws)

        # Checkpoints chain in the store; revival from it renders what the live set did.
        stored = await store.checkpoints("conv")
        assert stored == checkpoints
        assert (await store.latest_checkpoint("conv")) == (checkpoints[-1] if checkpoints else None)
        resume = await store.resume("conv")
        revived = WorkingSet("conv", resume.checkpoint, resume.events)
        assert revived.render(SYSTEM, POLICY, TOOLS).hash == renders[-1].hash
        return checkpoints


async def check_reachable(store: EventStore, ws: WorkingSet) -> None:
    checkpoint = ws.checkpoint
    if checkpoint is None:
        return
    folded = await expand(store, "conv", 0, checkpoint.position - 1)
    assert [e.position for e in folded] == list(range(checkpoint.position))
    for event in folded:
        body = event.body
        if isinstance(body, ToolResult) and body.artifact is not None:
            assert body.content.startswith("res")  # expanded to the full text
            assert len(body.content.encode()) == body.full_size
        tag = None
        if isinstance(body, UserMessage | ToolResult):
            tag = (body.text if isinstance(body, UserMessage) else body.content).split()[0]
        elif isinstance(body, AssistantMessage) and body.text:
            tag = body.text.split()[0]
        if tag is not None:
            hits = await recall(store, "conv", tag, k=10)
            assert event.position in [h.position for h in hits], tag


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns)
def test_invariants_through_the_sqlite_store(scenario: list[Any]) -> None:
    asyncio.run(_through_store(scenario))


def test_store_scenario_with_folds_and_artifacts() -> None:
    """A fixed scenario that surely folds several times and clips results to artifacts."""
    scenario: list[Any] = []
    for turn in range(12):
        scenario.append((40, [("tools", [(150, True), (5_000, True)], turn % 3 == 0), ("say", 40)]))
    checkpoints = asyncio.run(_through_store(scenario))
    assert len(checkpoints) >= 3


def test_tag_words_are_single_search_terms() -> None:
    # The reachability check relies on each tag being one full-text term.
    assert msgspec.json.encode(words("usr3x", 0).split()[0]) == b'"usr3x"'
