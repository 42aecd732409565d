"""Context assembly: the tail of the log rendered for one model call, under budget.

Two steps, so the audit can replay the second one from the log:

* ``plan`` decides, by log position, what to stub, clip or drop (the recipe):
  old tool results become stubs, oversized messages are clipped, and if the
  whole still exceeds the hard ceiling, spans of older events are stubbed by
  eviction weight (tool results first, then tool calls, then dialogue), then
  older turns are dropped,
  then the current user message is cut;
* ``materialize`` turns events plus those decisions into messages, section
  sizes and the payload hash.

Assembly never re-tokenizes history and its cost is linear in the tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torpor.compaction.recipe import RECIPE_VERSION, Recipe, Rendered, payload_hash, text_hash
from torpor.compaction.sections import Block
from torpor.compaction.slots import (
    INTERRUPTED_RESULT,
    Decisions,
    Slot,
    clip_keep,
    clip_note,
    freeable,
    layout,
    slot_cost,
    slot_message,
    text_tokens,
    tools_tokens,
    visible,
)
from torpor.compaction.tokens import MESSAGE_OVERHEAD, count_cached
from torpor.errors import ConfigError
from torpor.events import AssistantMessage, Event, ToolResult, UserMessage
from torpor.llm.protocol import ContextMessage, SystemMessage, ToolSpec

if TYPE_CHECKING:
    from torpor.compaction.policy import CompactionPolicy
    from torpor.store.protocol import Checkpoint

__all__ = [
    "EVICTION_WEIGHTS",
    "INTERRUPTED_RESULT",
    "Decisions",
    "ceiling_of",
    "decisions_of",
    "head_sections",
    "materialize",
    "plan",
    "tools_tokens",
]


def plan(
    events: Sequence[Event],
    system_prompt: str,
    handoff_tokens: int,
    policy: CompactionPolicy,
    tools: Sequence[ToolSpec] = (),
    calibration: float = 1.0,
) -> Decisions:
    """Choose stubs, clips and drops so the context fits the policy's hard ceiling."""
    encoding = policy.encoding
    slots, orphans = layout(events)
    d = Decisions(stubbed=set(), clipped={}, dropped=set(orphans))

    last_user = -1
    for index, _, call in reversed(slots):
        if call is None and type(events[index].body) is UserMessage:
            last_user = index
            break

    # Retention: only the newest results are worth their tokens; the rest point back. In
    # batches, decided result by result in log order as the render cache decides them: the
    # results past the newest `keep` are stubbed together once that frees `clear` tokens.
    limit = policy.clip_limit
    keep = policy.keep_tool_results
    clear = policy.clear_at_least
    window: list[Event] = []  # results not stubbed, oldest first
    overdue_free = 0
    for index, _, call in slots:
        if call is not None or type(events[index].body) is not ToolResult:
            continue
        window.append(events[index])
        if len(window) > keep:
            event = window[-keep - 1]
            cut = clip_keep(event, limit, encoding) if event.tokens > limit else None
            overdue_free += freeable(event, cut, encoding)
            if clear == 0 or overdue_free >= clear:
                overdue = len(window) - keep
                d.stubbed.update(e.position for e in window[:overdue])
                del window[:overdue]
                overdue_free = 0

    # Clip single oversized messages (the current user message is cut only if it must be).
    for index, _, call in slots:
        if call is not None or index == last_user:
            continue
        event = events[index]
        if event.tokens > limit and event.position not in d.stubbed:
            d.clipped[event.position] = clip_keep(event, limit, encoding)

    ceiling = ceiling_of(policy, calibration)
    fixed = text_tokens(system_prompt, encoding) + handoff_tokens + tools_tokens(tools, encoding)
    costs = [slot_cost(s, events, d, encoding) for s in slots]
    total = fixed + sum(costs)
    if total <= ceiling:
        return d

    d.ceiling_enforced = True
    groups = _groups(slots, last_user)
    # 1. Stub spans, as design source 001 weighs eviction (section 5.1): the contiguous run
    # of evictable events that frees what is missing and whose freed tokens carry the
    # greatest eviction weight (tool results 1.0, tool calls 0.8, dialogue 0.5, artifact
    # references 0.3), the oldest of equals. The system prompt, the markers and the
    # current ask are never stubbed.
    # The newest tool results of the turn are what the model just asked for (often a page
    # it will answer from): stubbed only when nothing else frees enough.
    newest = (last_user, *_newest_results(slots, events, last_user))
    while total > ceiling:
        need = total - ceiling
        span = _heaviest_span(slots, events, d, costs, newest, need, encoding)
        if not span:
            span = _heaviest_span(slots, events, d, costs, (last_user,), need, encoding)
        if not span:
            break
        for k in span:
            pos = events[slots[k][0]].position
            d.stubbed.add(pos)
            d.clipped.pop(pos, None)
            new = slot_cost(slots[k], events, d, encoding)
            total += new - costs[k]
            costs[k] = new
    # 2. Drop whole groups, oldest first.
    for members in groups:
        if total <= ceiling:
            break
        for k in members:
            index, _, call = slots[k]
            if call is None:
                d.dropped.add(events[index].position)
            total -= costs[k]
    # 3. Cut the current user message to what is left.
    if total > ceiling and last_user >= 0:
        k = next(k for k, s in enumerate(slots) if s[0] == last_user and s[2] is None)
        event = events[last_user]
        room = ceiling - (total - costs[k])
        keep = room - count_cached(clip_note(event), encoding) - MESSAGE_OVERHEAD
        if keep >= 1:
            d.clipped[event.position] = keep
            new = slot_cost(slots[k], events, d, encoding)
            total += new - costs[k]
    if total > ceiling:
        raise ConfigError(
            "system_prompt",
            f"the system prompt, markers and tool specs ({fixed} tokens) leave no room "
            f"under the hard ceiling of {ceiling} tokens",
        )
    return d


EVICTION_WEIGHTS = (
    ("tool result", 1.0),
    ("tool call", 0.8),
    ("message", 0.5),
    ("artifact reference", 0.3),
)
"""Design source 001's eviction weights (Table A), highest first: the order in which the
hard ceiling stubs what it must (system prompt, markers and the current ask: never)."""


def _tier(event: Event) -> int:
    """The index of an event's kind in :data:`EVICTION_WEIGHTS`."""
    body = event.body
    if type(body) is ToolResult:
        return 3 if body.artifact is not None else 0
    if type(body) is AssistantMessage and body.tool_calls:
        return 1
    return 2


def _newest_results(
    slots: Sequence[Slot], events: Sequence[Event], last_user: int
) -> tuple[int, ...]:
    """Event indexes of the results of the newest tool calls, when they come after the
    current ask (what the model just asked for; empty: none)."""
    found: list[int] = []
    for index, _, call in reversed(slots):
        if call is not None:
            continue  # an interrupted call's stand-in: tiny, never stubbed
        if index == last_user or type(events[index].body) is not ToolResult:
            break
        found.append(index)
    return tuple(found)


def _heaviest_span(
    slots: Sequence[Slot],
    events: Sequence[Event],
    d: Decisions,
    costs: Sequence[int],
    kept: tuple[int, ...],
    need: int,
    encoding: str,
) -> list[int]:
    """The slots of the span to stub next (empty: nothing left worth stubbing).

    The candidates are the evictable slots in log order whose stub is cheaper than what
    they hold, but for the events at the indexes ``kept``. For each start, the shortest
    run that frees ``need`` tokens (or the rest); the winner has the highest eviction
    weight per freed token (so a run is not preferred for sweeping dialogue in with a tool
    result), the oldest of equals. Linear: two pointers.
    """
    units: list[tuple[int, int, float]] = []  # (slot, tokens freed, weight)
    for k, (index, _, call) in enumerate(slots):
        if call is not None or index in kept:
            continue
        event = events[index]
        pos = event.position
        if pos in d.stubbed:
            continue
        clipped = d.clipped.pop(pos, None)
        d.stubbed.add(pos)
        freed = costs[k] - slot_cost(slots[k], events, d, encoding)
        d.stubbed.discard(pos)
        if clipped is not None:
            d.clipped[pos] = clipped
        if freed > 0:
            units.append((k, freed, EVICTION_WEIGHTS[_tier(event)][1] * freed))
    if not units:
        return []
    best: tuple[float, int, int] | None = None  # (weight per token, -start, end)
    end, freed, weight = 0, 0, 0.0
    for start in range(len(units)):
        while end < len(units) and freed < need:
            freed += units[end][1]
            weight += units[end][2]
            end += 1
        score = (weight / freed, -start, end)
        if best is None or score[:2] > best[:2]:
            best = score
        if end == len(units) and freed < need:
            break  # later starts free even less
        freed -= units[start][1]
        weight -= units[start][2]
    assert best is not None
    return [units[i][0] for i in range(-best[1], best[2])]


def ceiling_of(policy: CompactionPolicy, calibration: float) -> int:
    """The hard ceiling for one call: a calibration above 1 (the model counts more
    tokens than we estimate) tightens it in proportion."""
    return int(policy.effective_ceiling / max(1.0, calibration))


def _groups(slots: Sequence[Slot], last_user: int) -> list[list[int]]:
    """Slot indices grouped (a call with its results), oldest first, minus the current ask."""
    groups: list[list[int]] = []
    previous = None
    for k, (index, group, _) in enumerate(slots):
        if index == last_user and group == last_user:
            previous = None
            continue
        if group != previous:
            groups.append([])
            previous = group
        groups[-1].append(k)
    return groups


# --- materializing ---------------------------------------------------------------


def materialize(
    events: Sequence[Event],
    checkpoint: Checkpoint | None,
    head: Sequence[Block],
    system_prompt: str,
    tools: Sequence[ToolSpec],
    d: Decisions,
    encoding: str,
    version: int = RECIPE_VERSION,
    *,
    recalled: Block | None = None,
    task_card: int | None = None,
    pushed: tuple[tuple[int, int], ...] = (),
) -> Rendered:
    """Messages, section sizes, hash and recipe for a tail under the given decisions.

    ``head``: the blocks after the system prompt (:mod:`torpor.compaction.sections`);
    ``recalled``: the pushed section, rendered after the tail. ``task_card`` and
    ``pushed`` go into the recipe (the card event's position; the pushed positions
    with the tokens each kept). ``version``: the recipe version whose hash to
    compute (a rebuild of an older call's recipe computes the hash that call recorded).
    """
    slots, _ = layout(events)
    messages: list[ContextMessage] = [SystemMessage(system_prompt)]
    messages.extend(SystemMessage(block.text) for block in head)
    sections = head_sections(system_prompt, head, tools, encoding)
    last_user = -1
    for index, _, call in reversed(slots):
        if call is None and type(events[index].body) is UserMessage:
            if events[index].position not in d.dropped:
                last_user = index
            break
    synthesized: list[str] = []
    dropped = d.dropped
    for slot in slots:
        if not visible(slot, events, dropped):
            continue
        message = slot_message(slot, events, d, encoding)
        messages.append(message)
        cost = slot_cost(slot, events, d, encoding)
        index, _, call = slot
        if call is not None:
            synthesized.append(call.id)
            sections["tool_results"] += cost
        elif type(message) is ToolResult:
            sections["tool_results"] += cost
        elif index == last_user:
            sections["user"] += cost
        else:
            sections["tail"] += cost
    if recalled is not None:
        messages.append(SystemMessage(recalled.text))
        sections[recalled.name] = recalled.tokens
    recipe = Recipe(
        checkpoint_position=checkpoint.position if checkpoint is not None else None,
        cycle=checkpoint.cycle if checkpoint is not None else 0,
        tail_start=events[0].position if events else None,
        tail_end=max(e.position for e in events) if events else None,
        stubbed=tuple(sorted(d.stubbed)),
        clipped=tuple(sorted(d.clipped.items())),
        dropped=tuple(sorted(d.dropped)),
        synthesized=tuple(synthesized),
        ceiling_enforced=d.ceiling_enforced,
        system_hash=text_hash(system_prompt),
        tools=tuple(t.name for t in tools),
        encoding=encoding,
        version=version,
        turn=events[-1].turn if events else None,
        task_card=task_card,
        pushed=pushed,
    )
    return Rendered(
        messages=messages,
        recipe=recipe,
        hash=payload_hash(messages, tools, version),
        sections=sections,
        estimated_tokens=sum(sections.values()),
    )


def head_sections(
    system_prompt: str, head: Sequence[Block], tools: Sequence[ToolSpec], encoding: str
) -> dict[str, int]:
    """The section sizes of everything before the tail; the tail's start at zero.

    ``markers`` is always there (0 without a fold); other head blocks only when
    they render, so rows of calls without them look as they always did.
    """
    sections = {"system": text_tokens(system_prompt, encoding), "markers": 0}
    for block in head:
        sections[block.name] = block.tokens
    sections.update(tools=tools_tokens(tools, encoding), tail=0, tool_results=0, user=0)
    return sections


def decisions_of(recipe: Recipe) -> Decisions:
    """The decisions a recipe recorded, ready to materialize again."""
    return Decisions(
        stubbed=set(recipe.stubbed),
        clipped=dict(recipe.clipped),
        dropped=set(recipe.dropped),
        ceiling_enforced=recipe.ceiling_enforced,
        legacy_stubs=recipe.version < 3,
    )
