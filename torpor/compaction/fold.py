"""Folding: when the verbatim tail is over budget, checkpoint everything before a turn.

A fold is a new checkpoint, not a deletion: the log keeps every event, the
checkpoint says "positions before P are covered by these markers (and maybe a
summary)", and the working set drops its copies of them. The fold point is
always the first event of a turn, and never falls between a tool call and its
result, so the kept tail is a valid conversation on its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import msgspec

from torpor.compaction.background import grow, word_counts
from torpor.compaction.markers import (
    PROSE_WEIGHT,
    Hints,
    handoff_text,
    make_marker,
    merge_markers,
    prose_read,
)
from torpor.compaction.policy import CompactionPolicy
from torpor.compaction.tokens import MESSAGE_OVERHEAD, count_text
from torpor.compaction.working_set import WorkingSet
from torpor.events import AssistantMessage, Event, ToolResult, UserMessage
from torpor.store.protocol import Checkpoint

__all__ = ["FoldPlan", "Summarizer", "build_checkpoint", "plan_fold", "turn_starts"]


@runtime_checkable
class Summarizer(Protocol):
    """Optional narrative handoff: a model writes prose about the folded span.

    Stored in ``Checkpoint.summary``; pointer markers stay alongside it, so a
    lossy summary is never the only way back to what was folded.
    """

    async def summarize(self, previous_summary: str, events: Sequence[Event]) -> str: ...


class FoldPlan(msgspec.Struct, frozen=True, gc=False):
    """Where to fold and what the fold covers (``events``: the tail before ``position``)."""

    conversation_id: str
    position: int  # the new checkpoint position: first event of the oldest kept turn
    events: tuple[Event, ...]
    hints: tuple[Hints, ...]  # topic candidates of ``events``, one per event
    kept_turns: int
    kept_tokens: int
    folded_tokens: int
    forced: bool
    policy: CompactionPolicy


def turn_starts(tail: Sequence[Event]) -> list[int]:
    """Indices (> 0) of tail events where a fold may cut: a user message starting a turn,
    with no tool call before it whose result comes at or after it."""
    reach = -1  # furthest result index answering a call issued before the cursor
    issued: dict[str, int] = {}
    answered_at: dict[int, int] = {}  # assistant index -> last result index for its calls
    for i, event in enumerate(tail):
        body = event.body
        if isinstance(body, AssistantMessage):
            for call in body.tool_calls:
                issued[call.id] = i
        elif isinstance(body, ToolResult):
            c = issued.get(body.call_id)
            if c is not None and answered_at.get(c, -1) < i:
                answered_at[c] = i
    # A cut must also split the tail by position (a checkpoint covers the positions
    # before it): in turn order, a postponed user message sits after events with
    # higher positions, and cutting there would fold part of a kept turn.
    low = [0] * (len(tail) + 1)  # low[i]: lowest position in tail[i:]
    low[len(tail)] = 1 << 62
    for i in range(len(tail) - 1, -1, -1):
        low[i] = min(low[i + 1], tail[i].position)
    high = -1  # highest position in tail[:i]
    starts: list[int] = []
    for i, event in enumerate(tail):
        if (
            i > 0 and i > reach and isinstance(event.body, UserMessage)
            and high < event.position == low[i]
        ):
            starts.append(i)
        if event.position > high:
            high = event.position
        r = answered_at.get(i)
        if r is not None and r > reach:
            reach = r
    return starts


def plan_fold(
    ws: WorkingSet,
    policy: CompactionPolicy,
    *,
    force: bool = False,
    calibration: float = 1.0,
) -> FoldPlan | None:
    """A fold for this working set, or None when it is within budget or nothing can fold.

    Keeps the last ``policy.tail_turns`` turns verbatim, fewer (at least the
    current one) while they alone are over the working budget. ``force``: the
    model reported a prompt over the trigger ratio; fold even if our own
    estimate is within budget. ``calibration`` (reported / estimated) scales
    the estimate the same way.
    """
    tail = ws.tail
    if not tail:
        return None
    budget = policy.working_budget / max(1.0, calibration)
    total = ws.tail_tokens
    if not force and total <= budget:
        return None
    starts = ws.turn_starts()  # kept as events arrive: no walk over the tail here
    if not starts:
        return None
    keep = policy.tail_turns
    j = len(starts) - keep if len(starts) >= keep else -1  # index into starts; -1: keep all
    # Tokens kept by cutting at starts[k], summed from the end: only the kept turns are
    # walked (a fold keeps a few), never the part that is folded away.
    kept: dict[int, int] = {}
    running = 0
    k = len(starts) - 1
    lowest = starts[max(j, 0)]
    for i in range(len(tail) - 1, lowest - 1, -1):
        running += tail[i].tokens
        if i == starts[k]:
            kept[k] = running
            k -= 1
    while (kept[j] if j >= 0 else total) > budget and j + 1 < len(starts):
        j += 1
    if j < 0:
        if not force:
            return None
        j = 0
    cut = starts[j]
    return FoldPlan(
        conversation_id=ws.conversation_id,
        position=tail[cut].position,
        events=tuple(tail[:cut]),
        hints=tuple(ws.hints(0, cut)),
        kept_turns=len(starts) - j,
        kept_tokens=kept[j],
        folded_tokens=total - kept[j],
        forced=force,
        policy=policy,
    )


def build_checkpoint(
    plan: FoldPlan,
    previous: Checkpoint | None,
    cycle: int | None = None,
    summary: str = "",
    *,
    created_at: int | None = None,
    task_card: Event | None = None,
    memory: str = "",
) -> Checkpoint:
    """The checkpoint for a planned fold: previous markers merged with one for this span.

    ``summary``: a Summarizer's narrative (the previous one is carried over when
    none is given). ``memory``: the memory bundle rendered for this fold.
    ``tokens`` is what the handoff costs in a rendered context.
    ``task_card``: the card in effect (its TaskCard event), kept with the fold so a
    revival that reads only the events after it still has it; the previous
    checkpoint's when none is given.
    """
    policy = plan.policy
    before = previous.background if previous is not None else None
    marker = make_marker(plan.events, policy.max_topics, plan.hints, before)
    # The span joins the background the next span is scored against: from the words the
    # marker already read (the events' stored hints), so this costs what the marker did.
    background = grow(before, word_counts(plan.hints, PROSE_WEIGHT), prose_read(len(plan.events)))
    markers = merge_markers(
        previous.markers if previous is not None else (),
        marker,
        policy.max_markers,
        max_topics=policy.max_topics,
    )
    if cycle is None:
        cycle = previous.cycle + 1 if previous is not None else 1
    if not summary and previous is not None:
        summary = previous.summary
    checkpoint = Checkpoint(
        conversation_id=plan.conversation_id,
        position=plan.position,
        created_at=created_at if created_at is not None else int(time.time() * 1000),
        cycle=cycle,
        markers=markers,
        summary=summary,
        task_card=task_card if task_card is not None else (
            previous.task_card if previous is not None else None
        ),
        memory=memory,
        background=background,
    )
    tokens = count_text(handoff_text(checkpoint), policy.encoding) + MESSAGE_OVERHEAD
    return msgspec.structs.replace(checkpoint, tokens=tokens)
