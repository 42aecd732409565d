"""Incremental assembly renders exactly what assembly from scratch renders.

``WorkingSet.render`` keeps the rendered tail between calls and extends it;
``render_from_scratch`` plans and materializes the whole tail (the original
path, also what the audit replays). Whatever the sequence of appends, folds,
arbitrary checkpoints and renders under changing policies, prompts, tools and
calibrations, both give the same bytes, and so does a working set revived from
the same checkpoint and log. The byte estimate kept as running sums equals a
walk over every object.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torpor.compaction import (
    EXPAND_TOOL,
    RECALL_TOOL,
    CompactionPolicy,
    Rendered,
    WorkingSet,
    build_checkpoint,
    count_body,
    footprint,
    incremental,
    plan_fold,
    recipe,
    render,
    turn_starts,
)
from torpor.compaction.context_view import MessageView
from torpor.compaction.markers import encode_hints
from torpor.errors import ConfigError
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
)
from torpor.llm.protocol import ToolSpec
from torpor.store.protocol import Checkpoint, Marker

POLICIES = (
    CompactionPolicy(
        context_window=8_000,
        max_output_tokens=500,
        safety_margin=100,
        working_budget=2_000,
        clip_tokens=1_000,
    ),
    CompactionPolicy(  # everything stubbed at once, small clips
        context_window=8_000,
        max_output_tokens=500,
        safety_margin=100,
        working_budget=2_000,
        keep_tool_results=0,
        clear_at_least=0,
        clip_tokens=200,
    ),
    CompactionPolicy(  # a tight ceiling: the full path takes over often; small batches
        context_window=2_600,
        max_output_tokens=400,
        safety_margin=100,
        working_budget=500,
        keep_tool_results=1,
        clear_at_least=300,
        clip_tokens=400,
    ),
    CompactionPolicy(keep_tool_results=2, clear_at_least=0),  # each stubbed when it is old
    CompactionPolicy(keep_tool_results=1, clear_at_least=700, clip_tokens=500),  # batches
)
FOLD = CompactionPolicy(
    context_window=8_000,
    max_output_tokens=500,
    safety_margin=100,
    working_budget=1_500,
    tail_turns=2,
)
PROMPTS = ("You are careful.", "Answer briefly, cite files. " * 20)
TOOLSETS: tuple[tuple[ToolSpec, ...], ...] = ((), (RECALL_TOOL, EXPAND_TOOL))
TEXTS = ("lorem ipsum dolor ", "日本語のテキスト🙂🚀 ", "naïve café — ")  # multi-byte clips too


class Log:
    """Events as the store would make them (positions, turns, counted tokens)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.turn = 0
        self.calls = 0

    def add(self, body: Body) -> Event:
        pos = len(self.events)
        event = Event("c", pos, self.turn, count_body(body), 1_700_000_000_000 + pos, body)
        self.events.append(event)
        return event


sizes = st.sampled_from([1, 6, 60, 400, 1_400])
texts = st.integers(0, len(TEXTS) - 1)
ops = st.one_of(
    st.tuples(st.just("user"), sizes, texts),
    st.tuples(st.just("say"), sizes, texts),
    st.tuples(
        st.just("calls"),
        st.lists(st.tuples(sizes, st.booleans(), st.booleans()), min_size=1, max_size=3),
        st.booleans(),  # suspended first
    ),
    st.tuples(st.just("orphan"), sizes),
    st.tuples(st.just("abort"), st.booleans()),
    st.tuples(st.just("fold"), st.booleans()),
    st.tuples(st.just("checkpoint"), st.integers(0, 40)),
    st.tuples(
        st.just("render"),
        st.integers(0, len(POLICIES) - 1),
        st.sampled_from([1.0, 0.7, 1.6, 3.0]),
        st.integers(0, len(PROMPTS) - 1),
        st.integers(0, len(TOOLSETS) - 1),
    ),
)


def words(text: int, n: int, tag: str) -> str:
    return tag + " " + TEXTS[text] * n


def bodies_of(op: Any, log: Log) -> list[Body]:
    kind = op[0]
    if kind == "user":
        log.turn += 1
        return [UserMessage(words(op[2], op[1], f"u{log.turn}"))]
    if kind == "say":
        return [AssistantMessage(words(op[2], op[1], "a"))]
    if kind == "abort":
        return [Aborted("cancelled", partial_text="half an answer" if op[1] else "")]
    if kind == "orphan":  # a late or duplicate result: its call is not open
        return [ToolResult(f"k{log.calls}", "fetch", words(0, op[1], "late"))]
    _, results, suspended = op
    calls = []
    for _ in results:
        log.calls += 1
        calls.append(ToolCall(f"k{log.calls}", "fetch", {"n": log.calls}))
    out: list[Body] = [AssistantMessage("", tuple(calls))]
    if suspended:
        out.append(Suspended(tuple(c.id for c in calls)))
    for call, (size, answered, artifact) in zip(calls, results, strict=True):
        if not answered:
            continue
        if suspended:
            out.append(Resolved(call.id))
        content = words(1 if artifact else 0, size, "res")
        if artifact:
            out.append(ToolResult(call.id, "fetch", content, artifact=f"a{call.id}", full_size=9))
        else:
            out.append(ToolResult(call.id, "fetch", content))
    return out


def stored(event: Event) -> Event:
    """The event as a store with compaction's hint extractor returns it, or as an older row
    or another extractor left it (nothing, another format, bytes that do not decode)."""
    variant = event.position % 4
    hints = (None, encode_hints(event.body), b"\x00old", b"\x01\xc1")[variant]
    return msgspec.structs.replace(event, hints=hints)


def assert_same_fold(ws: WorkingSet, log: Log, force: bool) -> None:
    """A fold planned over events with hints stored at append equals one that extracts them."""
    revived = WorkingSet("c", ws.checkpoint, [stored(e) for e in log.events])
    assert revived.turn_starts() == ws.turn_starts()
    one, two = plan_fold(ws, FOLD, force=force), plan_fold(revived, FOLD, force=force)
    assert (one is None) == (two is None)
    if one is not None and two is not None:
        assert (one.position, one.hints) == (two.position, two.hints)
        assert (one.kept_tokens, one.folded_tokens) == (two.kept_tokens, two.folded_tokens)
        assert build_checkpoint(one, ws.checkpoint, created_at=0) == build_checkpoint(
            two, revived.checkpoint, created_at=0
        )


def render_all(
    ws: WorkingSet, log: Log, args: tuple[Any, ...]
) -> tuple[Rendered | None, Rendered | None, Rendered | None]:
    """(incremental, from scratch, revived) for one render op; None where it raised."""
    _, p, calibration, prompt, toolset = args
    call = (PROMPTS[prompt], POLICIES[p], TOOLSETS[toolset])
    revived = WorkingSet("c", ws.checkpoint, log.events)
    out: list[Rendered | None] = []
    for fn in (ws.render, ws.render_from_scratch, revived.render):
        try:
            out.append(fn(*call, calibration=calibration))
        except ConfigError as exc:
            assert exc.field == "system_prompt"
            out.append(None)
    assert revived.estimated_bytes() == revived.walk_bytes()
    return out[0], out[1], out[2]


def assert_same(one: Rendered | None, two: Rendered | None) -> None:
    assert (one is None) == (two is None)
    if one is not None and two is not None:
        assert one == two
        # A view of the render cache's list encodes as the list it reads as.
        one, two = (msgspec.structs.replace(r, messages=list(r.messages)) for r in (one, two))
        assert msgspec.msgpack.encode(one) == msgspec.msgpack.encode(two)


def run(first: int, script: list[Any]) -> None:
    log = Log()
    ws = WorkingSet("c", None, [])
    renders = 0
    for op in script:
        kind = op[0]
        if kind == "render":
            got, scratch, revived = render_all(ws, log, op)
            assert_same(got, scratch)
            assert_same(got, revived)
            renders += 1
        elif kind == "fold":
            assert_same_fold(ws, log, op[1])
            plan = plan_fold(ws, FOLD, force=op[1])
            if plan is not None:
                ws.apply(build_checkpoint(plan, ws.checkpoint, created_at=0))
        elif kind == "checkpoint":  # any position from the tail's start to past its head
            start = ws.tail[0].position if ws.tail else len(log.events)
            position = min(start + op[1] % 5, len(log.events))
            if position > 0 and (ws.checkpoint is None or position >= ws.checkpoint.position):
                cycle = ws.checkpoint.cycle + 1 if ws.checkpoint is not None else 1
                marker = Marker(0, position - 1, 0, 60_000, ("alpha.py",))
                ws.apply(Checkpoint("c", position, 0, cycle, (marker,)))
        else:
            if kind != "user" and not log.events:
                log.turn += 1
            ws.append([log.add(body) for body in bodies_of(op, log)])
        assert ws.estimated_bytes() == ws.walk_bytes()
        assert ws.turn_starts() == turn_starts(ws.tail)  # kept as events arrive = walked
    final = ("render", first, 1.0, 0, 1)
    got, scratch, revived = render_all(ws, log, final)
    assert_same(got, scratch)
    assert_same(got, revived)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(POLICIES) - 1), st.lists(ops, min_size=1, max_size=40))
def test_incremental_render_equals_render_from_scratch(first: int, script: list[Any]) -> None:
    run(first, script)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, len(POLICIES) - 1),
    st.lists(st.tuples(st.sampled_from(["user", "say", "calls", "orphan", "abort"]), sizes)),
    st.sampled_from([1, 3, incremental.STRIDE]),
)
def test_one_policy_many_renders(p: int, steps: list[tuple[str, int]], stride: int) -> None:
    """The actor's pattern: one policy, a render after every step (the cache keeps up);
    with chain states kept every ``stride`` slots, so a stub or a clip in the middle
    restarts the hash chain from every kind of place."""
    script: list[Any] = []
    for kind, size in steps:
        if kind == "calls":
            script.append(("calls", [(size, size != 6, size == 400)], size == 60))
        elif kind in ("user", "say"):
            script.append((kind, size, size % 3))
        elif kind == "orphan":
            script.append(("orphan", size))
        else:
            script.append(("abort", size > 6))
        script.append(("render", p, 1.0, 1, 1))
    with mock.patch.object(incremental, "STRIDE", stride):
        run(p, script)


# --- the cache is really incremental -------------------------------------------------


def chat(log: Log, turns: int, *, results: bool = True) -> list[Event]:
    out = []
    for i in range(turns):
        log.turn += 1
        out.append(log.add(UserMessage(f"question {i} " + "lorem " * 30)))
        if results:
            call = ToolCall(f"t{i}", "fetch", {"i": i})
            out.append(log.add(AssistantMessage("", (call,))))
            out.append(log.add(ToolResult(call.id, "fetch", "data " * 80)))
        out.append(log.add(AssistantMessage("answer " * 30)))
    return out


def test_render_after_append_touches_only_new_events(monkeypatch: pytest.MonkeyPatch) -> None:
    log = Log()
    ws = WorkingSet("c", None, chat(log, 30))
    policy = POLICIES[3]
    ws.render(PROMPTS[0], policy, TOOLSETS[1])
    seen: list[int] = []
    original = incremental.TailCache._add

    def counting(self: incremental.TailCache, tail: Any, i: int) -> None:
        seen.append(i)
        original(self, tail, i)

    def no_layout(*args: object) -> object:
        raise AssertionError("the whole tail was laid out again")

    monkeypatch.setattr(incremental.TailCache, "_add", counting)
    monkeypatch.setattr(render, "layout", no_layout)
    new = chat(log, 1)
    ws.append(new)
    rendered = ws.render(PROMPTS[0], policy, TOOLSETS[1])
    assert seen == list(range(len(ws.tail) - len(new), len(ws.tail)))
    monkeypatch.undo()
    assert rendered == ws.render_from_scratch(PROMPTS[0], policy, TOOLSETS[1])
    # The result that just left the keep window is a stub now, as from scratch.
    assert len(rendered.recipe.stubbed) == 31 - policy.keep_tool_results


def test_estimated_bytes_does_not_walk_the_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    log = Log()
    ws = WorkingSet("c", None, [])
    ws.append(chat(log, 20))
    ws.render(PROMPTS[0], POLICIES[0])
    expected = ws.walk_bytes()

    def no_walk(*args: object) -> int:
        raise AssertionError("estimated_bytes walked the events")

    monkeypatch.setattr(footprint, "event_bytes", no_walk)
    monkeypatch.setattr("torpor.compaction.working_set.event_bytes", no_walk)
    assert ws.estimated_bytes() == expected


def test_fold_drops_the_cache_and_rebuilds_it_from_the_kept_tail() -> None:
    log = Log()
    ws = WorkingSet("c", None, chat(log, 12))
    before = ws.render(PROMPTS[0], FOLD)
    plan = plan_fold(ws, FOLD)
    assert plan is not None
    ws.apply(build_checkpoint(plan, ws.checkpoint, created_at=0))
    after = ws.render(PROMPTS[0], FOLD)
    assert after.recipe.tail_start == plan.position != before.recipe.tail_start
    assert after == ws.render_from_scratch(PROMPTS[0], FOLD)
    assert after == WorkingSet("c", ws.checkpoint, log.events).render(PROMPTS[0], FOLD)


def test_clipped_texts_are_rebuilt_not_kept_twice() -> None:
    """Large messages are clipped on every call from where the cut falls, not cached copies."""
    log = Log()
    events = []
    for i in range(6):
        log.turn += 1
        events.append(log.add(UserMessage(f"paste {i} " + TEXTS[1] * 900)))
        events.append(log.add(AssistantMessage("ok " + TEXTS[2] * 900)))
    ws = WorkingSet("c", None, events)
    policy = CompactionPolicy(clip_tokens=601)  # some cuts split a character here
    first = ws.render(PROMPTS[0], policy)
    assert len(first.recipe.clipped) == 11  # all but the current ask
    again = ws.render(PROMPTS[0], policy)
    assert first == again == ws.render_from_scratch(PROMPTS[0], policy)
    cache = ws._cache
    assert cache is not None
    assert all(head >= 0 for _, head, _ in cache.rebuild.values())  # cuts located once
    assert any(extra for _, _, extra in cache.rebuild.values())  # ... one ends in U+FFFD
    texts = [m.text for m in first.messages[1:-1] if isinstance(m, UserMessage | AssistantMessage)]
    assert len(texts) == 11
    # Far less than one copy of the clipped texts.
    assert cache.footprint() * 5 < sum(footprint.str_bytes(t) for t in texts)
    assert ws.estimated_bytes() == ws.walk_bytes()


def test_policy_change_rebuilds_the_cache() -> None:
    log = Log()
    ws = WorkingSet("c", None, chat(log, 8))
    for policy in (POLICIES[0], POLICIES[1], POLICIES[0]):
        assert ws.render(PROMPTS[1], policy) == ws.render_from_scratch(PROMPTS[1], policy)


def test_the_payload_hash_covers_only_what_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call hashes the messages added since the last one; a stub in the middle rehashes
    from the chain state kept below it, not from the start."""
    log = Log()
    ws = WorkingSet("c", None, chat(log, 30, results=False))
    policy = CompactionPolicy(keep_tool_results=1, clear_at_least=0)
    ws.render(PROMPTS[0], policy, TOOLSETS[1])
    hashed: list[object] = []
    original = incremental.chain

    def counting(state: bytes, message: Any) -> bytes:
        hashed.append(message)
        return original(state, message)

    monkeypatch.setattr(incremental, "chain", counting)
    ws.append(chat(log, 1, results=False))
    rendered = ws.render(PROMPTS[0], policy, TOOLSETS[1])
    assert hashed == rendered.messages[-2:]  # the new question and answer, nothing else
    hashed.clear()
    ws.append(chat(log, 2))  # two tool results: the first one leaves the window, a stub
    rendered = ws.render(PROMPTS[0], policy, TOOLSETS[1])
    stub_at = next(i for i, m in enumerate(rendered.messages) if "elided" in str(m))
    assert 0 < len(hashed) <= len(rendered.messages) - stub_at + incremental.STRIDE
    assert len(hashed) < len(rendered.messages) // 2
    monkeypatch.undo()
    assert rendered == ws.render_from_scratch(PROMPTS[0], policy, TOOLSETS[1])


def test_a_recipe_version_this_torpor_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match="recipe version 4"):
        recipe.payload_hash([], (), 4)


def test_tool_specs_changed_in_place_between_calls_are_seen() -> None:
    """The cache keeps the specs' cost and digest; a list the caller changes is a change."""
    log = Log()
    ws = WorkingSet("c", None, chat(log, 3))
    specs = [RECALL_TOOL]
    first = ws.render(PROMPTS[0], POLICIES[0], specs)
    specs.append(EXPAND_TOOL)
    second = ws.render(PROMPTS[0], POLICIES[0], specs)
    assert second == ws.render_from_scratch(PROMPTS[0], POLICIES[0], specs)
    assert second.sections["tools"] > first.sections["tools"] and second.hash != first.hash


def test_a_rendered_context_shares_the_cache_and_never_changes_after() -> None:
    """The context of a call reads the render cache's own list (no copy per call), and a
    later render that turns an old result into a stub changes a copy, not that context."""
    log = Log()
    ws = WorkingSet("c", None, chat(log, 5))
    policy = CompactionPolicy(keep_tool_results=1, clear_at_least=0)
    first = ws.render(PROMPTS[0], policy, TOOLSETS[1])
    assert isinstance(first.messages, MessageView)
    cache = ws._cache
    assert cache is not None and first.messages._body is cache.messages  # shared
    snapshot = list(first.messages)
    ws.append(chat(log, 2))  # two more results: the older ones leave the window as stubs
    second = ws.render(PROMPTS[0], policy, TOOLSETS[1])
    assert len(second.recipe.stubbed) > len(first.recipe.stubbed)
    assert list(first.messages) == snapshot  # the earlier context is as it was sent
    assert first.messages[-1] is snapshot[-1] and first.messages[0] == snapshot[0]
    assert second == ws.render_from_scratch(PROMPTS[0], policy, TOOLSETS[1])
    with pytest.raises(IndexError):
        first.messages[len(snapshot)]
    assert first.messages[1:3] == snapshot[1:3] and first.messages == snapshot


@given(st.integers(0, 3), st.integers(0, 6), st.integers(0, 3), st.integers(-12, 12),
       st.integers(-12, 12), st.sampled_from([None, 1, 2, -1]))
def test_a_context_view_slices_and_indexes_as_its_list(
    h: int, n: int, a: int, start: int, stop: int, step: int | None
) -> None:
    head = [UserMessage(f"h{i}") for i in range(h)]
    body = [UserMessage(f"b{i}") for i in range(n + 2)]  # two past n: never read
    after = [UserMessage(f"a{i}") for i in range(a)]
    view = MessageView(head, body, n, after)
    whole = head + body[:n] + after
    assert list(view) == whole and len(view) == len(whole)
    assert list(reversed(view)) == whole[::-1]
    assert view[start:stop:step] == whole[start:stop:step]
    if -len(whole) <= start < len(whole):
        assert view[start] is whole[start]
