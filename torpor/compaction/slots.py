"""The tail as a list of rendered slots, and what each slot becomes under a decision.

A slot is one message of the rendered context: a logged event shown whole,
stubbed or clipped, or a stand-in result for a tool call that never got one.
Laying out the slots is where the shape guarantees live (what providers
reject otherwise): every assistant tool call is followed by a result for it
before the next other message; a call that never got one (a crash, a
suspension) gets an "interrupted" stand-in; a result whose call is not in the
tail is an orphan and is left out.

Costs come from the stored ``Event.tokens`` for events shown whole; only the
short texts invented here (stubs, clip notes, stand-ins) are counted, cached.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from torpor.compaction.tokens import (
    MESSAGE_OVERHEAD,
    aborted_text,
    artifact_note,
    count_cached,
    leading_text,
)
from torpor.events import (
    Aborted,
    AssistantMessage,
    Event,
    ToolCall,
    ToolResult,
    UserMessage,
    shown_text,
)
from torpor.llm.protocol import ContextMessage, ToolSpec

__all__ = [
    "INTERRUPTED_RESULT",
    "Decisions",
    "Slot",
    "clip_keep",
    "clip_note",
    "clip_source",
    "clipped",
    "clipped_cost",
    "clipped_with",
    "fixed_tokens",
    "freeable",
    "layout",
    "slot_cost",
    "slot_message",
    "stub",
    "stub_cost",
    "synthetic",
    "text_tokens",
    "tools_tokens",
    "visible",
    "whole",
]

INTERRUPTED_RESULT = "[interrupted: no result]"

_json = msgspec.json.Encoder(order="deterministic")

# A slot is one rendered message: (event index, group, call). ``call`` is set only
# for an interrupted-result stand-in; ``group`` is the index of the assistant
# message a result belongs to (its own index otherwise), so a call and its
# results are always stubbed or dropped together.
Slot = tuple[int, int, ToolCall | None]


class Decisions(msgspec.Struct, gc=False):
    """Assembly's choices by log position (mutable while planning)."""

    stubbed: set[int]
    clipped: dict[int, int]  # position -> tokens kept
    dropped: set[int]
    ceiling_enforced: bool = False
    legacy_stubs: bool = False  # stubs as recipes before version 3 rendered them (a rebuild)


def layout(events: Sequence[Event]) -> tuple[list[Slot], list[int]]:
    """Rendered order of the tail, with stand-ins for unanswered calls; and orphan results."""
    slots: list[Slot] = []
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


def stub(event: Event, legacy: bool = False) -> ContextMessage:
    """What an elided event renders to: about 10 tokens naming its position.

    The stub says only how to get the event back (``expand(position)``); the tool's
    name and call id stay on the message itself. ``legacy``: the ~18-token wording
    of recipes before version 3, so an audit rebuild of an older call still matches.
    """
    body = event.body
    pos = event.position
    if legacy:
        return _legacy_stub(event)
    if isinstance(body, ToolResult):
        return ToolResult(
            body.call_id, body.tool, f"[result elided: expand({pos})]", is_error=body.is_error
        )
    if isinstance(body, UserMessage):
        return UserMessage(f"[user message elided: expand({pos})]")
    calls: tuple[ToolCall, ...] = ()
    if isinstance(body, AssistantMessage):
        calls = tuple(ToolCall(c.id, c.name, {}) for c in body.tool_calls)
    return AssistantMessage(f"[message elided: expand({pos})]", calls)


def _legacy_stub(event: Event) -> ContextMessage:
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


def clip_note(event: Event) -> str:
    return f"\n[clipped: {event.tokens} tokens in full; expand({event.position}) shows all]"


def clip_text(text: str, keep: int, encoding: str) -> str:
    """The first ``keep`` tokens of ``text``; only a bounded prefix is ever encoded."""
    return leading_text(text[: keep * 8], keep, encoding)  # a token is rarely over 8 characters


def calls_text(body: AssistantMessage) -> str:
    parts: list[str] = []
    for call in body.tool_calls:
        parts.append(call.name)
        parts.append(_json.encode(call.arguments).decode())
    return "\n".join(parts)


def clip_source(event: Event) -> str:
    """The text clipping cuts: what the event renders as, minus any tool calls."""
    body = event.body
    if isinstance(body, UserMessage):
        return shown_text(body)
    if isinstance(body, AssistantMessage):
        return body.text
    if isinstance(body, ToolResult):
        return body.content
    assert isinstance(body, Aborted)
    return aborted_text(body)


def clipped_with(event: Event, head: str) -> ContextMessage:
    """The clipped message whose kept text is ``head`` (the clip note is added here)."""
    body = event.body
    text = head + clip_note(event)
    if isinstance(body, UserMessage):
        return UserMessage(text)
    if isinstance(body, AssistantMessage):
        return AssistantMessage(text, body.tool_calls)
    if isinstance(body, ToolResult):
        return ToolResult(body.call_id, body.tool, text, is_error=body.is_error)
    return AssistantMessage(text)


def clipped(event: Event, keep: int, encoding: str) -> ContextMessage:
    return clipped_with(event, clip_text(clip_source(event), keep, encoding))


def clip_keep(event: Event, limit: int, encoding: str) -> int:
    """Tokens of text an oversized event keeps so the clipped message fits ``limit``."""
    spare = fixed_tokens(event, encoding) + count_cached(clip_note(event), encoding)
    return max(1, limit - spare - MESSAGE_OVERHEAD)


def whole(event: Event) -> ContextMessage:
    body = event.body
    if isinstance(body, UserMessage) and body.scheduled is not None:
        return UserMessage(shown_text(body))  # the model can tell it from a person's
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


def synthetic(call: ToolCall) -> ToolResult:
    return ToolResult(call.id, call.name, INTERRUPTED_RESULT, is_error=True)


def text_tokens(text: str, encoding: str) -> int:
    return count_cached(text, encoding) + MESSAGE_OVERHEAD


def fixed_tokens(event: Event, encoding: str) -> int:
    """Tokens of what clipping keeps whole: an assistant's tool calls."""
    body = event.body
    if isinstance(body, AssistantMessage) and body.tool_calls:
        return count_cached(calls_text(body), encoding)
    return 0


def slot_cost(slot: Slot, events: Sequence[Event], d: Decisions, encoding: str) -> int:
    index, _, call = slot
    if call is not None:
        return text_tokens(INTERRUPTED_RESULT, encoding)
    event = events[index]
    pos = event.position
    if pos in d.stubbed:
        return stub_cost(stub(event, d.legacy_stubs), encoding)
    keep = d.clipped.get(pos)
    if keep is not None:
        return clipped_cost(event, keep, encoding)
    return event.tokens


def stub_cost(short: ContextMessage, encoding: str) -> int:
    """Tokens of a stub made by :func:`stub` (counted on its short text, cached)."""
    if isinstance(short, AssistantMessage) and short.tool_calls:
        return text_tokens(short.text + "\n" + calls_text(short), encoding)
    text = short.content if isinstance(short, ToolResult) else short.text
    return text_tokens(text, encoding)


def freeable(event: Event, keep: int | None, encoding: str) -> int:
    """Tokens stubbing a tool result frees: what it renders to now (whole, or clipped to
    ``keep`` tokens) minus its stub (negative for a result shorter than its stub)."""
    now = event.tokens if keep is None else clipped_cost(event, keep, encoding)
    return now - stub_cost(stub(event), encoding)


def clipped_cost(event: Event, keep: int, encoding: str) -> int:
    """Tokens of an event clipped to ``keep`` tokens of text (note and tool calls added)."""
    return (
        keep
        + count_cached(clip_note(event), encoding)
        + fixed_tokens(event, encoding)
        + MESSAGE_OVERHEAD
    )


def slot_message(
    slot: Slot, events: Sequence[Event], d: Decisions, encoding: str
) -> ContextMessage:
    index, _, call = slot
    if call is not None:
        return synthetic(call)
    event = events[index]
    pos = event.position
    if pos in d.stubbed:
        return stub(event, d.legacy_stubs)
    keep = d.clipped.get(pos)
    if keep is not None:
        return clipped(event, keep, encoding)
    return whole(event)


def visible(slot: Slot, events: Sequence[Event], dropped: set[int]) -> bool:
    index, group, call = slot
    if call is not None:
        return events[group].position not in dropped
    return events[index].position not in dropped


def tools_tokens(tools: Sequence[ToolSpec], encoding: str) -> int:
    """Tokens the tool schemas cost (counted on their JSON; cached, they rarely change)."""
    if not tools:
        return 0
    return count_cached(_json.encode(tuple(tools)).decode(), encoding)
