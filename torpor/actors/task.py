"""What the actor does for the task card and the pushed recall: log a card change, answer
the model's ``task_card`` tool, and choose the recalled section before a model call.

A card change is logged through :func:`~torpor.actors.turn_loop.logged`, the one
place an agent's appends go through, merged with the card in effect while its
lock is held: a change from code and one from the model's tool never overwrite
each other, and one made while a turn runs is in the log at once and in effect
from the turn's next model call (the working set picks it up as it is logged).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torpor.compaction.push import NOTHING, Pushed, push
from torpor.compaction.task_card import checked_card, merged_card
from torpor.errors import InvalidInput
from torpor.events import TaskCard, UserMessage

if TYPE_CHECKING:
    from torpor.actors.agent import Agent, Host

__all__ = ["CARD_FIELDS", "card_change", "card_of", "pushed_for", "tool_patch"]

CARD_FIELDS = ("goal", "constraints", "open_loops", "key_positions")


def card_of(agent: Agent) -> TaskCard | None:
    """The card in effect for a live agent (None: none set, or not live)."""
    ws = agent.ws
    event = ws.card if ws is not None else None
    return event.body if event is not None and isinstance(event.body, TaskCard) else None


def card_change(
    agent: Agent, patch: dict[str, Any], *, by: str = "code"
) -> Callable[[], list[TaskCard]]:
    """The bodies to log for a card change, made under the append lock (give it to
    :func:`~torpor.actors.turn_loop.logged`): the card in effect with ``patch``
    applied. Raises InvalidInput (a bad field) or TaskCardTooLarge (over
    ``AgentConfig.task_card_tokens``), and then nothing is logged."""
    budget = agent.profile.config.task_card_tokens
    encoding = agent.profile.policy.encoding

    def bodies() -> list[TaskCard]:
        card = merged_card(card_of(agent), by=by, **patch)
        checked_card(card, budget, encoding)
        return [card]

    return bodies


def tool_patch(arguments: dict[str, Any]) -> dict[str, Any]:
    """The model's ``task_card`` arguments as a patch (InvalidInput for an unknown field)."""
    unknown = sorted(set(arguments) - set(CARD_FIELDS))
    if unknown:
        raise InvalidInput(unknown[0], "is not a task card field")
    return {name: arguments[name] for name in CARD_FIELDS if name in arguments}


def _question(agent: Agent) -> str:
    """The current turn's user message ("" when there is none)."""
    ws = agent.ws
    if ws is None:
        return ""
    for event in reversed(ws.tail):
        body = event.body
        if isinstance(body, UserMessage):
            return body.text if event.turn == agent.turn else ""
    return ""


async def pushed_for(agent: Agent, host: Host) -> Pushed:
    """The recalled section for the next model call: nothing unless push is on and the
    conversation has folded history; the same within a turn while the question, the
    card and the fold stay the same (kept on the working set, not searched again).
    A push that fails is logged and leaves nothing pushed."""
    config = agent.profile.config
    ws = agent.ws
    if not config.push_recall or ws is None or ws.checkpoint is None:
        return NOTHING
    card = ws.card
    key = (agent.turn, card.position if card is not None else -1, ws.checkpoint.position)
    memo = ws.push_memo
    if memo is not None and memo[0] == key:
        return memo[1]
    try:
        result = await push(
            host.store,
            agent.id,
            question=_question(agent),
            card=card_of(agent),
            before=ws.checkpoint.position,
            budget=config.push_tokens,
            lam=config.push_lambda,
            encoding=agent.profile.policy.encoding,
        )
    except Exception as exc:
        # Push is a head start, not the answer: a failed search leaves the call without a
        # recalled section (pull still works), never a failed turn. Not memoised: the next
        # call tries again.
        host.log.warning("push_failed", conversation_id=agent.id, error=repr(exc))
        return NOTHING
    ws.push_memo = (key, result)
    return result
