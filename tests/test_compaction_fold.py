"""Folding: where the checkpoint goes, what it covers, how checkpoints chain, and revival."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from torpor.compaction import (
    MESSAGE_OVERHEAD,
    CompactionPolicy,
    WorkingSet,
    build_checkpoint,
    count_body,
    count_text,
    handoff_text,
    plan_fold,
    turn_starts,
)
from torpor.events import (
    Aborted,
    AssistantMessage,
    Body,
    Event,
    ToolCall,
    ToolResult,
    UserMessage,
)
from torpor.store.protocol import Checkpoint

POLICY = CompactionPolicy(
    context_window=16_000,
    max_output_tokens=1_000,
    safety_margin=200,
    working_budget=600,
    tail_turns=2,
)


class Log:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.turn = 0

    def add(self, body: Body, *, new_turn: bool = False) -> Event:
        if new_turn:
            self.turn += 1
        pos = len(self.events)
        event = Event("c", pos, self.turn, count_body(body), 1_800_000_000_000 + pos * 1000, body)
        self.events.append(event)
        return event

    def turn_with_tool(self, i: int, words: int = 30) -> list[Event]:
        return [
            self.add(
                UserMessage(f"turn {i} about service_{i}.yaml " + "x " * words), new_turn=True
            ),
            self.add(AssistantMessage("", (ToolCall(f"t{i}", "grep", {"q": f"id_{i}"}),))),
            self.add(ToolResult(f"t{i}", "grep", "match " * words)),
            self.add(AssistantMessage(f"answer {i}")),
        ]


def live(log: Log, policy: CompactionPolicy = POLICY) -> tuple[WorkingSet, list[Checkpoint]]:
    """Feed events one turn at a time, folding whenever a plan says so (like the actor)."""
    ws = WorkingSet("c", None, [])
    checkpoints: list[Checkpoint] = []
    for event in log.events:
        ws.append([event])
        plan = plan_fold(ws, policy)
        if plan is not None:
            checkpoint = build_checkpoint(plan, ws.checkpoint, created_at=0)
            ws.apply(checkpoint)
            checkpoints.append(checkpoint)
    return ws, checkpoints


def test_no_fold_under_budget() -> None:
    log = Log()
    log.turn_with_tool(1, words=5)
    ws = WorkingSet("c", None, log.events)
    assert plan_fold(ws, POLICY) is None


def test_fold_keeps_last_turns_and_cuts_at_a_user_message() -> None:
    log = Log()
    for i in range(8):
        log.turn_with_tool(i)
    ws = WorkingSet("c", None, log.events)
    assert ws.tail_tokens > POLICY.working_budget
    plan = plan_fold(ws, POLICY)
    assert plan is not None
    assert isinstance(log.events[plan.position].body, UserMessage)
    assert plan.kept_turns == 2
    assert plan.position == log.events[-8].position
    assert [e.position for e in plan.events] == list(range(plan.position))
    assert plan.kept_tokens + plan.folded_tokens == ws.tail_tokens


def test_fold_keeps_fewer_turns_when_they_alone_are_over_budget() -> None:
    log = Log()
    for i in range(4):
        log.turn_with_tool(i, words=10)
    log.turn_with_tool(9, words=400)  # the current turn alone is over budget
    ws = WorkingSet("c", None, log.events)
    plan = plan_fold(ws, POLICY)
    assert plan is not None
    assert plan.kept_turns == 1
    assert plan.position == log.events[-4].position


def test_nothing_to_fold_when_one_turn_is_everything() -> None:
    log = Log()
    log.turn_with_tool(1, words=2_000)
    ws = WorkingSet("c", None, log.events)
    assert ws.tail_tokens > POLICY.working_budget
    assert plan_fold(ws, POLICY) is None


def test_force_folds_even_under_budget() -> None:
    log = Log()
    for i in range(4):
        log.turn_with_tool(i, words=2)
    ws = WorkingSet("c", None, log.events)
    assert plan_fold(ws, POLICY) is None
    plan = plan_fold(ws, POLICY, force=True)
    assert plan is not None and plan.forced and plan.kept_turns == 2


def test_never_cuts_between_a_call_and_its_late_result() -> None:
    log = Log()
    log.add(UserMessage("start"), new_turn=True)
    log.add(AssistantMessage("", (ToolCall("slow", "job", {}),)))
    log.add(UserMessage("meanwhile"), new_turn=True)  # a user message before the result
    log.add(ToolResult("slow", "job", "finished"))
    log.add(UserMessage("next"), new_turn=True)
    starts = turn_starts(log.events)
    assert 2 not in starts  # would separate call 1 from result 3
    assert starts == [4]


def test_checkpoints_chain_and_markers_cover_every_folded_position() -> None:
    log = Log()
    for i in range(40):
        log.turn_with_tool(i)
    ws, checkpoints = live(log)
    assert len(checkpoints) >= 5
    previous: Checkpoint | None = None
    for checkpoint in checkpoints:
        assert checkpoint.cycle == (previous.cycle + 1 if previous else 1)
        if previous is not None:
            assert checkpoint.position > previous.position
        covered = [p for m in checkpoint.markers for p in range(m.start, m.end + 1)]
        assert covered == list(range(checkpoint.position))
        text = handoff_text(checkpoint)
        assert checkpoint.tokens == count_text(text) + MESSAGE_OVERHEAD
        previous = checkpoint
    assert ws.tail_tokens <= POLICY.working_budget
    assert ws.checkpoint is not None
    assert ws.tail[0].position == ws.checkpoint.position


def test_marker_topics_come_from_the_folded_span() -> None:
    log = Log()
    for i in range(8):
        log.turn_with_tool(i)
    ws = WorkingSet("c", None, log.events)
    plan = plan_fold(ws, POLICY)
    assert plan is not None
    checkpoint = build_checkpoint(plan, None, created_at=0)
    (marker,) = checkpoint.markers
    assert marker.start == 0 and marker.end == plan.position - 1
    assert marker.topics and all(
        t
        in " ".join(
            getattr(e.body, "text", "")
            + getattr(e.body, "content", "")
            + str(getattr(e.body, "tool_calls", ""))
            for e in plan.events
        )
        for t in marker.topics
    )


def test_summary_is_stored_alongside_markers_and_carried_over() -> None:
    log = Log()
    for i in range(8):
        log.turn_with_tool(i)
    ws = WorkingSet("c", None, log.events)
    plan = plan_fold(ws, POLICY)
    assert plan is not None
    first = build_checkpoint(plan, None, 1, "they discussed services", created_at=0)
    assert first.summary == "they discussed services" and first.markers
    assert "they discussed services" in handoff_text(first)
    ws.apply(first)
    for i in range(8, 14):
        ws.append(log.turn_with_tool(i))
    plan2 = plan_fold(ws, POLICY)
    assert plan2 is not None
    second = build_checkpoint(plan2, first, created_at=0)
    assert second.cycle == 2 and second.summary == first.summary


def test_revived_working_set_renders_byte_identical_to_the_live_one() -> None:
    log = Log()
    for i in range(30):
        log.turn_with_tool(i)
    ws, checkpoints = live(log)
    checkpoint = checkpoints[-1]
    revived = WorkingSet("c", checkpoint, log.events)
    one = ws.render("system", POLICY)
    two = revived.render("system", POLICY)
    assert one.hash == two.hash and one.messages == two.messages and one.recipe == two.recipe
    # ...and they keep folding identically afterwards.
    for i in range(30, 40):
        for event in log.turn_with_tool(i):
            for target in (ws, revived):
                target.append([event])
                plan = plan_fold(target, POLICY)
                if plan is not None:
                    target.apply(build_checkpoint(plan, target.checkpoint, created_at=0))
    assert ws.checkpoint == revived.checkpoint
    assert ws.render("system", POLICY).hash == revived.render("system", POLICY).hash


# --- cut points kept as events arrive ------------------------------------------------

cut_turns = st.lists(
    st.tuples(
        st.integers(0, 3),  # slots the turn's user message moves earlier in the log (postponed)
        st.lists(st.sampled_from(["say", "call", "late", "orphan", "abort"]), max_size=4),
    ),
    min_size=1,
    max_size=12,
)


def postponed_log(turns: list[tuple[int, list[str]]], *, arrival: bool = True) -> list[Event]:
    """Events in turn order whose positions say some user messages arrived while the turn
    before them was still open (they were postponed behind it).

    ``arrival``: turns are numbered in arrival order, as the runtime numbers them; without
    it a user message may also overtake an earlier turn's (what the working set accepts).
    """
    ordered: list[tuple[int, Body]] = []
    late: list[str] = []
    for turn, (_, steps) in enumerate(turns, start=1):
        ordered.append((turn, UserMessage(f"u{turn} about path/{turn}.py")))
        for k, step in enumerate(steps):
            call_id = f"c{turn}_{k}"
            if step in ("call", "late"):
                ordered.append((turn, AssistantMessage("", (ToolCall(call_id, "grep", {}),))))
                if step == "call":
                    ordered.append((turn, ToolResult(call_id, "grep", f"hit {call_id}")))
                else:
                    late.append(call_id)  # answered in a later turn
            elif step == "orphan" and late:
                ordered.append((turn, ToolResult(late.pop(0), "grep", "late answer")))
            elif step == "orphan":
                ordered.append((turn, ToolResult("nobody", "grep", "no call")))
            elif step == "abort":
                ordered.append((turn, Aborted("cancelled")))
            else:
                ordered.append((turn, AssistantMessage(f"reply {turn}.{k}")))
    # Log order: a user message (not the first) moves up to `shift` slots earlier, past
    # events of earlier turns only, and never past another user message (turns are
    # numbered in arrival order).
    log = list(range(len(ordered)))
    shifts = iter(shift for shift, _ in turns)
    for i, (turn, body) in enumerate(ordered):
        if type(body) is not UserMessage:
            continue
        shift = next(shifts)
        if turn == 1:
            continue
        at = log.index(i)
        to = at
        while to > 0 and at - to < shift:
            before_turn, before = ordered[log[to - 1]]
            if before_turn >= turn or (arrival and type(before) is UserMessage):
                break
            to -= 1
        log.insert(to, log.pop(at))
    position = {index: p for p, index in enumerate(log)}
    events = [
        Event("c", position[i], turn, count_body(body), 0, body)
        for i, (turn, body) in enumerate(ordered)
    ]
    return sorted(events, key=lambda e: (e.turn, e.position))


@settings(max_examples=300, deadline=None)
@given(cut_turns, st.integers(0, 40), st.booleans())
def test_cut_points_kept_as_events_arrive_equal_turn_starts(
    turns: list[tuple[int, list[str]]], fold_at: int, arrival: bool
) -> None:
    events = postponed_log(turns, arrival=arrival)
    ws = WorkingSet("c", None, [])
    for n, event in enumerate(events):
        ws.append([event])
        assert ws.turn_starts() == turn_starts(ws.tail)
        if n == fold_at:
            plan = plan_fold(ws, POLICY, force=True)
            if plan is not None:
                ws.apply(build_checkpoint(plan, ws.checkpoint, created_at=0))
                assert ws.turn_starts() == turn_starts(ws.tail)
                if arrival:  # a fold never passes a message still waiting for its turn
                    assert all(e.position >= plan.position for e in ws.tail)
    if not arrival:
        return
    revived = WorkingSet("c", ws.checkpoint, sorted(events, key=lambda e: e.position))
    assert revived.tail == ws.tail
    assert revived.turn_starts() == ws.turn_starts()
