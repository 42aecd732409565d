"""Context assembly: the tail of the log rendered for one model call, under budget.

Two steps, so the audit can replay the second one from the log:

* ``plan`` decides, by log position, what to stub, clip or drop (the recipe);
* ``materialize`` turns events plus those decisions into messages, sizes and a hash.

Assembly never re-tokenizes history: an unmodified event costs its stored
``tokens``; only the short texts assembly invents (stubs, clip notes, the
interrupted-result stand-in) are counted, through a cache. Cost is linear in
the tail.

Shape guarantees (what providers reject otherwise): every assistant tool call
is followed by a result for it before the next other message; a call that
never got one (a crash, a suspension) gets an "interrupted" stand-in; a
result whose call is not in the rendered tail is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from torpor.compaction.recipe import Recipe, Rendered, payload_hash, text_hash
from torpor.compaction.tokens import (
    MESSAGE_OVERHEAD,
    aborted_text,
    artifact_note,
    count_cached,
    get_encoding,
)
from torpor.errors import ConfigError
from torpor.events import Aborted, AssistantMessage, Event, ToolCall, ToolResult, UserMessage
from torpor.llm.protocol import ContextMessage, SystemMessage, ToolSpec

if TYPE_CHECKING:
    from torpor.compaction.policy import CompactionPolicy
    from torpor.store.protocol import Checkpoint

__all__ = ["INTERRUPTED_RESULT", "Decisions", "materialize", "plan", "tools_tokens"]

INTERRUPTED_RESULT = "[interrupted: no result]"

_json = msgspec.json.Encoder(order="deterministic")

# A slot is one rendered message: (event index, group, call). ``call`` is set only
# for an interrupted-result stand-in; ``group`` is the index of the assistant
# message a result belongs to (its own index otherwise), so a call and its
# results are always stubbed or dropped together.
_Slot = tuple[int, int, ToolCall | None]


class Decisions(msgspec.Struct, gc=False):
    """Assembly's choices by log position (mutable while planning)."""

    stubbed: set[int]
    clipped: dict[int, int]  # position -> tokens kept
    dropped: set[int]
    ceiling_enforced: bool = False


def _layout(events: Sequence[Event]) -> tuple[list[_Slot], list[int]]:
    """Rendered order of the tail, with stand-ins for unanswered calls; and orphan results."""
    slots: list[_Slot] = []
    orphans: list[int] = []
    group = -1
    unanswered: dict[str, ToolCall] = {}

    def close() -> None:
        for call in unanswered.values():
            slots.append((group, group, call))
        unanswered.clear()

    for i, event in enumerate(events):
        body = event.body
        kind = type(body)
        if kind is ToolResult:
            assert isinstance(body, ToolResult)
            if unanswered.pop(body.call_id, None) is not None:
                slots.append((i, group, None))
            else:
                orphans.append(event.position)
        elif kind is UserMessage:
            close()
            slots.append((i, i, None))
        elif kind is AssistantMessage:
            assert isinstance(body, AssistantMessage)
            close()
            slots.append((i, i, None))
            if body.tool_calls:
                group = i
                for call in body.tool_calls:
                    unanswered[call.id] = call
        elif kind is Aborted:
            assert isinstance(body, Aborted)
            close()  # the turn is over: whatever it waited for is not coming
            if body.partial_text:
                slots.append((i, i, None))
        # suspended / resolved / parked / unparked do not render
    close()
    return slots, orphans


# --- what one slot renders to -------------------------------------------------------


def _stub(event: Event) -> ContextMessage:
    body = event.body
    pos = event.position
    if isinstance(body, ToolResult):
        return ToolResult(
            body.call_id,
            body.tool,
            f"[result of {body.tool} at event {pos} elided; expand({pos}) or recall(query)]",
            is_error=body.is_error,
        )
    if isinstance(body, UserMessage):
        return UserMessage(f"[user message at event {pos} elided; expand({pos}) to read it]")
    calls: tuple[ToolCall, ...] = ()
    if isinstance(body, AssistantMessage):
        calls = tuple(ToolCall(c.id, c.name, {}) for c in body.tool_calls)
    return AssistantMessage(
        f"[assistant message at event {pos} elided; expand({pos}) to read it]", calls
    )


def _clip_note(event: Event) -> str:
    return f"\n[clipped: {event.tokens} tokens in full; expand({event.position}) shows all]"


def _clip_text(text: str, keep: int, encoding: str) -> str:
    """The first ``keep`` tokens of ``text``; only a bounded prefix is ever encoded."""
    enc = get_encoding(encoding)
    prefix = text[: keep * 8]  # a token is rarely longer than 8 characters
    tokens = enc.encode_ordinary(prefix)
    if len(tokens) <= keep:
        return prefix
    return enc.decode(tokens[:keep], errors="replace")


def _calls_text(body: AssistantMessage) -> str:
    parts: list[str] = []
    for call in body.tool_calls:
        parts.append(call.name)
        parts.append(_json.encode(call.arguments).decode())
    return "\n".join(parts)


def _clipped(event: Event, keep: int, encoding: str) -> ContextMessage:
    body = event.body
    note = _clip_note(event)
    if isinstance(body, UserMessage):
        return UserMessage(_clip_text(body.text, keep, encoding) + note)
    if isinstance(body, AssistantMessage):
        return AssistantMessage(_clip_text(body.text, keep, encoding) + note, body.tool_calls)
    if isinstance(body, ToolResult):
        content = _clip_text(body.content, keep, encoding) + note
        return ToolResult(body.call_id, body.tool, content, is_error=body.is_error)
    assert isinstance(body, Aborted)
    return AssistantMessage(_clip_text(aborted_text(body), keep, encoding) + note)


def _whole(event: Event) -> ContextMessage:
    body = event.body
    if isinstance(body, UserMessage | AssistantMessage):
        return body
    if isinstance(body, ToolResult):
        if body.artifact is None:
            return body
        return ToolResult(
            body.call_id,
            body.tool,
            body.content + artifact_note(body.full_size, event.position),
            is_error=body.is_error,
            artifact=body.artifact,
            full_size=body.full_size,
        )
    assert isinstance(body, Aborted)
    return AssistantMessage(aborted_text(body))


def _synthetic(call: ToolCall) -> ToolResult:
    return ToolResult(call.id, call.name, INTERRUPTED_RESULT, is_error=True)


def _text_tokens(text: str, encoding: str) -> int:
    return count_cached(text, encoding) + MESSAGE_OVERHEAD


def _fixed_part(event: Event, encoding: str) -> int:
    """Tokens of what clipping keeps whole: an assistant's tool calls."""
    body = event.body
    if isinstance(body, AssistantMessage) and body.tool_calls:
        return count_cached(_calls_text(body), encoding)
    return 0


def _cost(slot: _Slot, events: Sequence[Event], d: Decisions, encoding: str) -> int:
    index, _, call = slot
    if call is not None:
        return _text_tokens(INTERRUPTED_RESULT, encoding)
    event = events[index]
    pos = event.position
    if pos in d.stubbed:
        stub = _stub(event)
        if isinstance(stub, AssistantMessage) and stub.tool_calls:
            return _text_tokens(stub.text + "\n" + _calls_text(stub), encoding)
        return _text_tokens(stub.content if isinstance(stub, ToolResult) else stub.text, encoding)
    keep = d.clipped.get(pos)
    if keep is not None:
        return (
            keep
            + count_cached(_clip_note(event), encoding)
            + _fixed_part(event, encoding)
            + MESSAGE_OVERHEAD
        )
    return event.tokens


def _message(slot: _Slot, events: Sequence[Event], d: Decisions, encoding: str) -> ContextMessage:
    index, _, call = slot
    if call is not None:
        return _synthetic(call)
    event = events[index]
    pos = event.position
    if pos in d.stubbed:
        return _stub(event)
    keep = d.clipped.get(pos)
    if keep is not None:
        return _clipped(event, keep, encoding)
    return _whole(event)


def _visible(slot: _Slot, events: Sequence[Event], dropped: set[int]) -> bool:
    index, group, call = slot
    if call is not None:
        return events[group].position not in dropped
    return events[index].position not in dropped


def tools_tokens(tools: Sequence[ToolSpec], encoding: str) -> int:
    """Tokens the tool schemas cost (counted on their JSON; cached, they rarely change)."""
    if not tools:
        return 0
    return count_cached(_json.encode(tuple(tools)).decode(), encoding)


# --- planning --------------------------------------------------------------------


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
    slots, orphans = _layout(events)
    d = Decisions(stubbed=set(), clipped={}, dropped=set(orphans))

    last_user = -1
    for index, _, call in reversed(slots):
        if call is None and type(events[index].body) is UserMessage:
            last_user = index
            break

    # Retention: only the newest results are worth their tokens; the rest point back.
    seen = 0
    for index, _, call in reversed(slots):
        if call is None and type(events[index].body) is ToolResult:
            seen += 1
            if seen > policy.keep_tool_results:
                d.stubbed.add(events[index].position)

    # Clip single oversized messages (the current user message is cut only if it must be).
    limit = policy.clip_limit
    for index, _, call in slots:
        if call is not None or index == last_user:
            continue
        event = events[index]
        if event.tokens > limit and event.position not in d.stubbed:
            spare = _fixed_part(event, encoding) + count_cached(_clip_note(event), encoding)
            d.clipped[event.position] = max(1, limit - spare - MESSAGE_OVERHEAD)

    ceiling = int(policy.effective_ceiling / max(1.0, calibration))
    fixed = _text_tokens(system_prompt, encoding) + handoff_tokens + tools_tokens(tools, encoding)
    costs = [_cost(s, events, d, encoding) for s in slots]
    total = fixed + sum(costs)
    if total <= ceiling:
        return d

    d.ceiling_enforced = True
    groups = _groups(slots, last_user)
    # 1. Stub whole groups, oldest first.
    for members in groups:
        if total <= ceiling:
            break
        for k in members:
            index, _, call = slots[k]
            if call is not None:
                continue
            pos = events[index].position
            if pos in d.stubbed:
                continue
            d.stubbed.add(pos)
            d.clipped.pop(pos, None)
            new = _cost(slots[k], events, d, encoding)
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
        keep = room - count_cached(_clip_note(event), encoding) - MESSAGE_OVERHEAD
        if keep >= 1:
            d.clipped[event.position] = keep
            new = _cost(slots[k], events, d, encoding)
            total += new - costs[k]
    if total > ceiling:
        raise ConfigError(
            "system_prompt",
            f"the system prompt, markers and tool specs ({fixed} tokens) leave no room "
            f"under the hard ceiling of {ceiling} tokens",
        )
    return d


def _groups(slots: Sequence[_Slot], last_user: int) -> list[list[int]]:
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
    handoff: str,
    handoff_tokens: int,
    system_prompt: str,
    tools: Sequence[ToolSpec],
    d: Decisions,
    encoding: str,
) -> Rendered:
    """Messages, section sizes, hash and recipe for a tail under the given decisions."""
    slots, _ = _layout(events)
    system_tokens = _text_tokens(system_prompt, encoding)
    messages: list[ContextMessage] = [SystemMessage(system_prompt)]
    if handoff:
        messages.append(SystemMessage(handoff))
    else:
        handoff_tokens = 0
    sections = {
        "system": system_tokens,
        "markers": handoff_tokens,
        "tools": tools_tokens(tools, encoding),
        "tail": 0,
        "tool_results": 0,
        "user": 0,
    }
    last_user = -1
    for index, _, call in reversed(slots):
        if call is None and type(events[index].body) is UserMessage:
            if events[index].position not in d.dropped:
                last_user = index
            break
    synthesized: list[str] = []
    dropped = d.dropped
    for slot in slots:
        if not _visible(slot, events, dropped):
            continue
        message = _message(slot, events, d, encoding)
        messages.append(message)
        cost = _cost(slot, events, d, encoding)
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
    recipe = Recipe(
        checkpoint_position=checkpoint.position if checkpoint is not None else None,
        cycle=checkpoint.cycle if checkpoint is not None else 0,
        tail_start=events[0].position if events else None,
        tail_end=events[-1].position if events else None,
        stubbed=tuple(sorted(d.stubbed)),
        clipped=tuple(sorted(d.clipped.items())),
        dropped=tuple(sorted(d.dropped)),
        synthesized=tuple(synthesized),
        ceiling_enforced=d.ceiling_enforced,
        system_hash=text_hash(system_prompt),
        tools=tuple(t.name for t in tools),
        encoding=encoding,
    )
    return Rendered(
        messages=messages,
        recipe=recipe,
        hash=payload_hash(messages, tools),
        sections=sections,
        estimated_tokens=sum(sections.values()),
    )


def decisions_of(recipe: Recipe) -> Decisions:
    """The decisions a recipe recorded, ready to materialize again."""
    return Decisions(
        stubbed=set(recipe.stubbed),
        clipped=dict(recipe.clipped),
        dropped=set(recipe.dropped),
        ceiling_enforced=recipe.ceiling_enforced,
    )
