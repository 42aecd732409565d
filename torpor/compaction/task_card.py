"""The task card: a small structured block per conversation that is never evicted.

Design source 001 (section 3.1) keeps a compact "index card" of the current task
(goal, constraints, open loops, key events) beside the pointer markers: it is the
proxy the push retrieval conditions on, and it must survive every fold. Here it is
a :class:`~torpor.events.TaskCard` event in the log (the whole card after each
change), so revival and the audit rebuild it exactly; the working set keeps the
latest one it has seen and renders it right after the system prompt.

Bounded by its own budget (``AgentConfig.task_card_tokens``): a change whose card
would exceed it is refused with :class:`~torpor.errors.TaskCardTooLarge` and
nothing is logged. Refused rather than truncated, because a silently cut goal or
constraint is worse than a caller told to shorten it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torpor.compaction.tokens import MESSAGE_OVERHEAD, count_cached
from torpor.errors import InvalidInput, TaskCardTooLarge
from torpor.events import TaskCard
from torpor.llm.protocol import ToolSpec
from torpor.text import check_text

__all__ = [
    "MAX_ITEMS",
    "TASK_CARD_TOOL",
    "card_lines",
    "card_tokens",
    "card_text",
    "checked_card",
    "merged_card",
]

MAX_ITEMS = 32
"""Most constraints, open loops or key positions one card holds (the token budget binds
first in practice; this bounds the work of checking a hostile argument)."""

_HEADER = "Task card (kept in context across folds; positions can be expanded):"

TASK_CARD_TOOL = ToolSpec(
    name="task_card",
    description=(
        "Update this conversation's task card, which stays in your context for good. "
        "Give only the fields to change; a list replaces the old list."
    ),
    parameters={
        "type": "object",
        "properties": {
            "goal": {"type": "string"},
            "constraints": {"type": "array", "items": {"type": "string"}},
            "open_loops": {"type": "array", "items": {"type": "string"}},
            "key_positions": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        },
    },
)


def card_lines(card: TaskCard) -> str:
    """The card's fields as lines (empty fields left out)."""
    lines: list[str] = []
    if card.goal:
        lines.append(f"Goal: {card.goal}")
    if card.constraints:
        lines.append("Constraints:")
        lines.extend(f"- {item}" for item in card.constraints)
    if card.open_loops:
        lines.append("Open loops:")
        lines.extend(f"- {item}" for item in card.open_loops)
    if card.key_positions:
        lines.append("Key events: " + ", ".join(f"#{p}" for p in card.key_positions))
    return "\n".join(lines)


def card_text(card: TaskCard | None) -> str:
    """What the model is sent for a card ("" for no card or an empty one)."""
    if card is None:
        return ""
    body = card_lines(card)
    return f"{_HEADER}\n{body}" if body else ""


def card_tokens(card: TaskCard | None, encoding: str) -> int:
    """The card's cost in context, message framing included (0 when it renders nothing)."""
    text = card_text(card)
    return count_cached(text, encoding) + MESSAGE_OVERHEAD if text else 0


def merged_card(
    current: TaskCard | None,
    *,
    goal: object = None,
    constraints: object = None,
    open_loops: object = None,
    key_positions: object = None,
    by: str = "code",
) -> TaskCard:
    """``current`` with the given fields replaced (None: unchanged), every argument checked.

    Raises :class:`~torpor.errors.InvalidInput` naming the field.
    """
    base = current if current is not None else TaskCard()
    if goal is not None:
        check_text(goal, "goal")
    return TaskCard(
        goal=base.goal if goal is None else str(goal),
        constraints=base.constraints if constraints is None else _texts(constraints, "constraints"),
        open_loops=base.open_loops if open_loops is None else _texts(open_loops, "open_loops"),
        key_positions=(
            base.key_positions if key_positions is None else _positions(key_positions)
        ),
        by="model" if by == "model" else "code",
    )


def checked_card(card: TaskCard, budget: int, encoding: str) -> int:
    """The card's token cost; :class:`~torpor.errors.TaskCardTooLarge` above ``budget``."""
    tokens = card_tokens(card, encoding)
    if tokens > budget:
        raise TaskCardTooLarge(tokens, budget)
    return tokens


def _texts(value: object, what: str) -> tuple[str, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise InvalidInput(what, f"must be a list of strings, got {type(value).__name__}")
    if len(value) > MAX_ITEMS:
        raise InvalidInput(what, f"holds at most {MAX_ITEMS} items, got {len(value)}")
    for item in value:
        check_text(item, what)
    return tuple(value)


def _positions(value: object) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise InvalidInput("key_positions", f"must be a list of positions, got {value!r}")
    if len(value) > MAX_ITEMS:
        raise InvalidInput("key_positions", f"holds at most {MAX_ITEMS} items, got {len(value)}")
    for item in value:
        if type(item) is not int or item < 0:
            raise InvalidInput("key_positions", f"must hold positions (ints >= 0), got {item!r}")
    return tuple(value)
