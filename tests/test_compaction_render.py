"""Assembly: reducers, tool-call pairing, clipping, the hard ceiling, sections and hashes."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest

from torpor.compaction import (
    INTERRUPTED_RESULT,
    MESSAGE_OVERHEAD,
    CompactionPolicy,
    WorkingSet,
    count_body,
    count_text,
    decode_recipe,
    encode_recipe,
)
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
from torpor.llm.protocol import SystemMessage, ToolSpec
from torpor.store.protocol import Checkpoint, Marker

SMALL = CompactionPolicy(
    context_window=8_000,
    max_output_tokens=500,
    safety_margin=100,
    working_budget=2_000,
    clip_tokens=1_000,
)


class Log:
    """Builds events the way the store would (positions, turns, counted tokens)."""

    def __init__(self, conversation_id: str = "c") -> None:
        self.conversation_id = conversation_id
        self.events: list[Event] = []
        self.turn = 0

    def add(self, *bodies: Body, new_turn: bool = False) -> list[Event]:
        if new_turn:
            self.turn += 1
        out = []
        for body in bodies:
            pos = len(self.events)
            event = Event(
                self.conversation_id,
                pos,
                self.turn,
                count_body(body),
                1_700_000_000_000 + pos,
                body,
            )
            self.events.append(event)
            out.append(event)
        return out

    def user(self, text: str) -> list[Event]:
        return self.add(UserMessage(text), new_turn=True)

    def call(self, *ids: str, tool: str = "read", text: str = "") -> list[Event]:
        calls = tuple(ToolCall(i, tool, {"path": f"/tmp/{i}.txt"}) for i in ids)
        return self.add(AssistantMessage(text, calls))

    def result(self, call_id: str, content: str, tool: str = "read") -> list[Event]:
        return self.add(ToolResult(call_id, tool, content))

    def say(self, text: str) -> list[Event]:
        return self.add(AssistantMessage(text))


def ws_of(log: Log, checkpoint: Checkpoint | None = None) -> WorkingSet:
    ws = WorkingSet(log.conversation_id, checkpoint, [])
    ws.append(e for e in log.events if checkpoint is None or e.position >= checkpoint.position)
    return ws


def assert_paired(messages: Sequence[object]) -> None:
    """Every tool call answered before the next non-result message; no result without a call."""
    open_calls: set[str] = set()
    for message in messages:
        if isinstance(message, ToolResult):
            assert message.call_id in open_calls, f"orphan result {message.call_id}"
            open_calls.discard(message.call_id)
            continue
        assert not open_calls, f"unanswered calls {open_calls} before {message!r}"
        if isinstance(message, AssistantMessage):
            open_calls = {c.id for c in message.tool_calls}
    assert not open_calls


def test_starts_with_system_prompt_and_reuses_event_bodies() -> None:
    log = Log()
    log.user("hello")
    log.say("hi there")
    rendered = ws_of(log).render("be brief", SMALL)
    assert rendered.messages[0] == SystemMessage("be brief")
    assert rendered.messages[1] is log.events[0].body  # shared, not copied
    assert rendered.messages[2] is log.events[1].body
    assert rendered.recipe.tail_start == 0 and rendered.recipe.tail_end == 1


def test_old_tool_results_become_stubs_and_recent_ones_stay_whole() -> None:
    log = Log()
    log.user("read five files")
    for i in range(5):
        log.call(f"k{i}")
        log.result(f"k{i}", f"content of file {i} " * 50)
    log.say("done")
    policy = CompactionPolicy(
        context_window=8_000,
        max_output_tokens=500,
        safety_margin=100,
        working_budget=2_000,
        keep_tool_results=2,
        clear_at_least=0,  # each as soon as it is older than the newest two
    )
    rendered = ws_of(log).render("sys", policy)
    results = [m for m in rendered.messages if isinstance(m, ToolResult)]
    assert [r.call_id for r in results] == ["k0", "k1", "k2", "k3", "k4"]
    for stub in results[:3]:
        assert "elided" in stub.content and "expand(" in stub.content
        assert count_text(stub.content) < 30
    assert results[3].content.startswith("content of file 3")
    assert results[4].content.startswith("content of file 4")
    stubbed_positions = {e.position for e in log.events if isinstance(e.body, ToolResult)}
    assert set(rendered.recipe.stubbed) == set(sorted(stubbed_positions)[:3])
    assert_paired(rendered.messages)


def test_old_tool_results_are_stubbed_in_batches_that_free_enough() -> None:
    """With clear_at_least, results past the newest keep_tool_results stay whole until
    stubbing them all frees that many tokens; then they become stubs together."""
    policy = CompactionPolicy(
        context_window=8_000,
        max_output_tokens=500,
        safety_margin=100,
        working_budget=4_000,
        keep_tool_results=2,
        clear_at_least=500,
    )
    log = Log()
    log.user("read eight files")
    ws = WorkingSet("c", None, log.events)
    stubbed: list[tuple[int, ...]] = []
    previous: list[object] = []
    for i in range(8):
        ws.append(log.call(f"k{i}") + log.result(f"k{i}", f"content of file {i} " * 50))
        rendered = ws.render("sys", policy)
        assert rendered == ws.render_from_scratch("sys", policy)
        assert rendered == WorkingSet("c", None, log.events).render("sys", policy)
        # Between batches the previous context is a prefix of this one (cacheable).
        if rendered.recipe.stubbed == (stubbed[-1] if stubbed else ()):
            assert rendered.messages[: len(previous)] == previous
        stubbed.append(rendered.recipe.stubbed)
        previous = rendered.messages
    results = [e.position for e in log.events if isinstance(e.body, ToolResult)]
    # ~225 tokens freed a stub: a batch needs three overdue results.
    assert stubbed == [(), (), (), (), tuple(results[:3]), tuple(results[:3]),
                       tuple(results[:3]), tuple(results[:6])]
    eager = msgspec.structs.replace(policy, clear_at_least=0)
    assert ws.render("sys", eager).recipe.stubbed == tuple(results[:6])
    # What batching keeps whole costs less than clear_at_least more than stubbing it.
    extra = rendered.estimated_tokens - ws.render("sys", eager).estimated_tokens
    assert 0 <= extra < policy.clear_at_least


def test_unanswered_call_gets_an_interrupted_result() -> None:
    log = Log()
    log.user("do two things")
    log.call("a", "b")
    log.result("b", "b done")
    log.add(Suspended(("a",), reason="approval"))
    rendered = ws_of(log).render("sys", SMALL)
    assert_paired(rendered.messages)
    tail = rendered.messages[-2:]
    assert isinstance(tail[0], ToolResult) and tail[0].call_id == "b"
    assert isinstance(tail[1], ToolResult) and tail[1].call_id == "a"
    assert tail[1].content == INTERRUPTED_RESULT and tail[1].is_error
    assert rendered.recipe.synthesized == ("a",)


def test_suspension_resolved_renders_the_real_result_in_place() -> None:
    log = Log()
    log.user("needs approval")
    log.call("a")
    log.add(Suspended(("a",)))
    log.add(Resolved("a"), ToolResult("a", "read", "approved"))
    log.say("ok")
    rendered = ws_of(log).render("sys", SMALL)
    assert_paired(rendered.messages)
    assert rendered.recipe.synthesized == ()
    kinds = [type(m).__name__ for m in rendered.messages]
    assert kinds == [
        "SystemMessage",
        "UserMessage",
        "AssistantMessage",
        "ToolResult",
        "AssistantMessage",
    ]


def test_crash_mid_tools_then_new_turn_is_still_well_formed() -> None:
    log = Log()
    log.user("first")
    log.call("x")
    log.add(Aborted("crashed", partial_text="", detail="boom"))
    log.user("second")
    log.result("x", "late result")  # arrives after its turn ended: an orphan
    log.say("answer")
    rendered = ws_of(log).render("sys", SMALL)
    assert_paired(rendered.messages)
    assert rendered.recipe.synthesized == ("x",)
    assert log.events[4].position in rendered.recipe.dropped
    assert not any(
        isinstance(m, ToolResult) and m.content == "late result" for m in rendered.messages
    )


def test_aborted_with_partial_text_renders_as_interrupted_answer() -> None:
    log = Log()
    log.user("tell me")
    log.add(Aborted("cancelled", partial_text="Once upon"))
    log.add(Aborted("cancelled"))  # nothing streamed: nothing rendered
    rendered = ws_of(log).render("sys", SMALL)
    last = rendered.messages[-1]
    assert isinstance(last, AssistantMessage)
    assert last.text.startswith("Once upon") and "[interrupted: cancelled]" in last.text
    assert len(rendered.messages) == 3
    assert count_body(Aborted("cancelled")) == 0
    assert log.events[1].tokens == count_text(last.text) + MESSAGE_OVERHEAD


def test_oversized_message_is_clipped_with_a_pointer() -> None:
    log = Log()
    log.user("paste")
    log.say("word " * 3_000)  # ~3,000 tokens > clip 1,000
    log.user("and now?")
    rendered = ws_of(log).render("sys", SMALL)
    clipped = rendered.messages[2]
    assert isinstance(clipped, AssistantMessage)
    assert "expand(1)" in clipped.text
    assert count_text(clipped.text) <= SMALL.clip_limit
    assert rendered.recipe.clipped and rendered.recipe.clipped[0][0] == 1


def test_giant_user_message_never_breaks_the_ceiling() -> None:
    log = Log()
    for i in range(3):
        log.user(f"question {i}")
        log.call(f"c{i}")
        log.result(f"c{i}", "data " * 400)
        log.say(f"answer {i}")
    log.user("huge " * 20_000)
    policy = SMALL
    rendered = ws_of(log).render("sys", policy)
    assert rendered.estimated_tokens <= policy.effective_ceiling
    assert rendered.recipe.ceiling_enforced
    assert rendered.messages[0] == SystemMessage("sys")
    last = rendered.messages[-1]
    assert isinstance(last, UserMessage) and last.text.startswith("huge huge")
    assert_paired(rendered.messages)
    real = count_text(
        "".join(getattr(m, "text", "") or getattr(m, "content", "") for m in rendered.messages)
    )
    assert real <= policy.effective_ceiling


def test_ceiling_stubs_old_turns_before_touching_the_current_message() -> None:
    log = Log()
    log.user("old " * 1_500)
    log.say("old answer " * 500)
    log.user("current " * 2_500)
    policy = CompactionPolicy(
        context_window=6_000,
        max_output_tokens=500,
        safety_margin=100,
        working_budget=2_000,
        clip_tokens=3_000,
    )
    rendered = ws_of(log).render("sys", policy)
    assert rendered.estimated_tokens <= policy.effective_ceiling
    assert 0 in rendered.recipe.stubbed
    last = rendered.messages[-1]
    assert isinstance(last, UserMessage) and "expand(" not in last.text  # kept whole


def test_system_prompt_over_the_ceiling_is_a_config_error() -> None:
    log = Log()
    log.user("hi")
    with pytest.raises(ConfigError) as info:
        ws_of(log).render("rule " * 10_000, SMALL)
    assert info.value.field == "system_prompt"


def test_handoff_markers_render_after_the_system_prompt() -> None:
    log = Log()
    for i in range(4):
        log.user(f"q{i}")
        log.say(f"a{i}")
    checkpoint = Checkpoint(
        "c", 4, 0, 1, (Marker(0, 3, 0, 60_000, ("alpha.py",)),), summary="they talked"
    )
    rendered = ws_of(log, checkpoint).render("sys", SMALL)
    handoff = rendered.messages[1]
    assert isinstance(handoff, SystemMessage)
    assert "events 0\u20133" in handoff.text and "alpha.py" in handoff.text
    assert "they talked" in handoff.text
    assert rendered.sections["markers"] == count_text(handoff.text) + MESSAGE_OVERHEAD
    assert rendered.recipe.checkpoint_position == 4
    assert rendered.recipe.tail_start == 4


def test_sections_add_up_and_hash_is_deterministic() -> None:
    log = Log()
    log.user("look")
    log.call("a")
    log.result("a", "found it")
    log.say("here")
    log.user("thanks")
    tool = ToolSpec("read", "read a file", {"type": "object", "properties": {}})
    ws = ws_of(log)
    one = ws.render("sys", SMALL, [tool])
    two = ws.render("sys", SMALL, [tool])
    assert one.hash == two.hash and len(one.hash) == 64
    assert sum(one.sections.values()) == one.estimated_tokens
    assert one.sections["user"] == log.events[-1].tokens
    assert one.sections["tool_results"] == log.events[2].tokens
    assert one.sections["tools"] > 0
    assert one.hash != ws.render("sys!", SMALL, [tool]).hash
    assert one.hash != ws.render("sys", SMALL).hash
    assert decode_recipe(encode_recipe(one.recipe)) == one.recipe


def test_calibration_tightens_the_ceiling() -> None:
    log = Log()
    log.user("a " * 2_000)
    log.say("b " * 2_000)
    log.user("c")
    policy = CompactionPolicy(
        context_window=8_000,
        max_output_tokens=500,
        safety_margin=100,
        working_budget=2_000,
        clip_tokens=3_000,
    )
    plain = ws_of(log).render("sys", policy)
    tight = ws_of(log).render("sys", policy, calibration=2.0)
    assert not plain.recipe.ceiling_enforced
    assert tight.recipe.ceiling_enforced
    assert tight.estimated_tokens * 2 <= policy.effective_ceiling


def test_pending_calls_and_head() -> None:
    log = Log()
    ws = WorkingSet("c", None, [])
    assert ws.head is None and ws.pending_calls() == () and ws.last_turn == 0
    ws.append(log.user("go"))
    ws.append(log.call("a", "b"))
    assert ws.pending_calls() == ("a", "b")
    ws.append(log.result("a", "ok"))
    ws.append(log.add(Suspended(("b",))))
    assert ws.pending_calls() == ("b",)
    ws.append(log.add(Aborted("cancelled")))
    assert ws.pending_calls() == ()
    assert ws.head == 4 and ws.last_turn == 1
    assert ws.tail_tokens == sum(e.tokens for e in log.events)
    with pytest.raises(ValueError):
        ws.append([log.events[0]])


def test_apply_drops_folded_events_and_keeps_tokens_consistent() -> None:
    log = Log()
    for i in range(3):
        log.user(f"q{i}")
        log.say(f"a{i}")
    ws = ws_of(log)
    before = ws.estimated_bytes()
    ws.apply(Checkpoint("c", 4, 0, 1, (Marker(0, 3, 0, 0),)))
    assert [e.position for e in ws.tail] == [4, 5]
    assert ws.tail_tokens == log.events[4].tokens + log.events[5].tokens
    assert ws.estimated_bytes() < before
    with pytest.raises(ValueError):
        ws.apply(Checkpoint("c", 2, 0, 2))


def test_stubs_cost_about_ten_tokens() -> None:
    from torpor.compaction.slots import stub

    for body in (
        ToolResult("call_8f3a", "read_file", "x" * 5_000),
        UserMessage("y" * 5_000),
        AssistantMessage("z" * 5_000),
    ):
        short = stub(Event("c", 123_456, 1, 0, 0, body))
        text = short.content if isinstance(short, ToolResult) else short.text
        assert "expand(123456)" in text
        assert count_text(text) <= 11, text


def test_ceiling_stubs_tool_results_before_dialogue() -> None:
    """Design source 001's eviction weights: under the hard ceiling, an old tool result is
    stubbed before the older dialogue around it (which an oldest-first policy would take)."""
    log = Log()
    log.user("question " * 300)
    log.call("c1")
    log.result("c1", "data " * 1_500)
    log.say("answer " * 300)
    log.user("current " * 100)
    policy = CompactionPolicy(
        context_window=2_000,
        max_output_tokens=500,
        safety_margin=100,
        working_budget=800,
        clip_tokens=3_000,
    )
    fits_by_stubbing(log, policy, (2,))  # the result only: question and answer stay whole


def test_the_task_card_and_recalled_section_render_the_same_on_the_cached_and_full_paths() -> None:
    # Order: system prompt, task card, markers, the tail, the recalled section; the render
    # cache keeps its hash chain across a card change (the prefix changes) and across
    # recalled sections that change from call to call (hashed after the tail, per call).
    from torpor.compaction.push import recalled_block
    from torpor.compaction.task_card import card_text
    from torpor.events import TaskCard

    log = Log()
    log.add(TaskCard(goal="first goal"))
    log.user("hello")
    log.say("hi")
    ws = WorkingSet("c", None, log.events)
    assert [e.kind for e in ws.tail] == ["user", "assistant"]  # a card is never in the tail
    renders = []
    for step in range(4):
        if step == 2:
            ws.note_card(log.add(TaskCard(goal="second goal", open_loops=("x",)))[0])
        ws.append(log.user(f"question {step}"))
        recalled = recalled_block(log.events[1:3], [20, 20], SMALL.encoding) if step % 2 else None
        pushed = ((1, 20), (2, 20)) if step % 2 else ()
        rendered = ws.render("sys", SMALL, recalled=recalled, pushed=pushed)
        assert rendered == ws.render_from_scratch("sys", SMALL, recalled=recalled, pushed=pushed)
        card = ws.card
        assert card is not None and isinstance(card.body, TaskCard)
        assert rendered.messages[1] == SystemMessage(card_text(card.body))
        assert rendered.recipe.task_card == card.position
        assert rendered.recipe.pushed == pushed
        if recalled is not None:
            assert rendered.messages[-1] == SystemMessage(recalled.text)
            assert rendered.sections["recalled"] == recalled.tokens
        else:
            assert "recalled" not in rendered.sections
        renders.append(rendered)
    assert "second goal" in renders[-1].messages[1].text  # type: ignore[union-attr]
    assert len({r.hash for r in renders}) == 4


def under_ceiling(log: Log, window: int, stubbed: tuple[int, ...]) -> None:
    """Render ``log`` where only the hard ceiling makes room (results are not retired)."""
    policy = CompactionPolicy(
        context_window=window,
        max_output_tokens=300,
        safety_margin=50,
        working_budget=600,
        clip_tokens=3_000,
        keep_tool_results=5,
    )
    fits_by_stubbing(log, policy, stubbed)


def fits_by_stubbing(log: Log, policy: CompactionPolicy, stubbed: tuple[int, ...]) -> None:
    """Rendered under ``policy``, ``log`` hits the hard ceiling and fits by stubbing exactly
    ``stubbed``: nothing dropped, every call still paired with its result."""
    rendered = ws_of(log).render("sys", policy)
    assert rendered.recipe.ceiling_enforced
    assert rendered.estimated_tokens <= policy.effective_ceiling
    assert rendered.recipe.stubbed == stubbed
    assert rendered.recipe.dropped == ()
    assert_paired(rendered.messages)


def test_ceiling_stubs_the_heaviest_span_not_every_old_result() -> None:
    """The span that frees what is missing with the most eviction weight per token: one
    large old result is enough, so the smaller, older result stays whole (a policy that
    stubs every tool result oldest first would take both)."""
    log = Log()
    log.user("question " * 300)
    log.call("c1")
    log.result("c1", "small " * 200)  # position 2
    log.say("answer " * 300)
    log.user("again " * 50)
    log.call("c2")
    log.result("c2", "data " * 600)  # position 6
    log.say("answer " * 50)
    log.user("current " * 50)
    under_ceiling(log, 1_700, (6,))


def test_ceiling_stubs_one_contiguous_span_when_no_single_event_is_enough() -> None:
    """When no one event frees enough, the stubs are one run of adjacent events where the
    freed tokens weigh most (the two newer results), not every result oldest first."""
    log = Log()
    log.user("fetch " * 20)  # 0
    log.call("a")  # 1
    log.result("a", "old " * 400)  # 2
    log.say("talk " * 300)  # 3
    log.user("more " * 20)  # 4
    log.call("b", "c")  # 5
    log.result("b", "data " * 400)  # 6
    log.result("c", "info " * 400)  # 7
    log.say("done " * 20)  # 8
    log.user("current " * 50)  # 9
    under_ceiling(log, 1_350, (6, 7))


@pytest.mark.parametrize("push", [False, True])
def test_ceiling_never_stubs_the_result_just_asked_for_while_older_ones_free_enough(
    push: bool,
) -> None:
    """Issue 25: the page the model just asked for is what it answers from. The heaviest
    span alone would be that newest page (a pure tool result; the older pages come with the
    model's reasoning between them, which weighs less), so it was the one elided while the
    older pages of the same turn stayed whole. With ``push``, a pushed recalled section is
    what brings the context over the ceiling (as ``push_recall=True`` did)."""
    from torpor.compaction.push import recalled_block

    log = Log()
    log.user("summarise the report " * 5)  # 0: the current ask
    log.call("a", text="reading the first page " * 50)  # 1
    log.result("a", "alpha " * 500)  # 2
    log.call("b", text="now the second page " * 50)  # 3
    log.result("b", "beta " * 500)  # 4
    log.call("c", text="and the third page " * 50)  # 5
    log.result("c", "gamma " * 950)  # 6: the newest result
    policy = CompactionPolicy(
        context_window=3_600 if push else 2_600, max_output_tokens=300, safety_margin=50,
        working_budget=1_000, clip_tokens=3_000, keep_tool_results=5,
    )
    ws = ws_of(log)
    recalled = None
    if push:
        assert not ws.render("sys", policy).recipe.ceiling_enforced  # the push tips it over
        older = Log("c")
        older.user("an older fact " * 400)
        recalled = recalled_block(older.events, [700], policy.encoding)
    rendered = ws.render("sys", policy, recalled=recalled)
    assert rendered.recipe.ceiling_enforced
    assert rendered.estimated_tokens <= policy.effective_ceiling
    assert 6 not in rendered.recipe.stubbed and rendered.recipe.stubbed
    assert rendered.recipe.dropped == ()
    assert any(isinstance(m, ToolResult) and m.content == "gamma " * 950
               for m in rendered.messages)
    assert_paired(rendered.messages)


def test_the_newest_result_is_stubbed_when_nothing_else_frees_enough() -> None:
    """The newest result is kept only while something else can make room: alone over the
    ceiling with nothing older to stub, it is stubbed rather than the call failing."""
    log = Log()
    log.user("go on " * 500)  # 0: the current ask, never stubbed
    log.call("a")  # 1: its stub would free nothing
    log.result("a", "gamma " * 700)  # 2
    policy = CompactionPolicy(
        context_window=2_000, max_output_tokens=300, safety_margin=50, working_budget=1_000,
        clip_tokens=3_000, keep_tool_results=5,
    )
    rendered = ws_of(log).render("sys", policy)
    assert rendered.recipe.ceiling_enforced
    assert rendered.recipe.stubbed == (2,) and rendered.recipe.dropped == ()
    assert rendered.estimated_tokens <= policy.effective_ceiling
