"""``rt.task(conversation)``: the handle a caller sets and reads a task card through."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from torpor.actors.mailbox import CardRequest
from torpor.actors.state import AgentState
from torpor.actors.task import card_of
from torpor.compaction.task_card import merged_card
from torpor.errors import AgentParked
from torpor.events import Event, TaskCard

if TYPE_CHECKING:
    from torpor.runtime.hosting import AgentHost
    from torpor.runtime.ports import Conversations, Starter
    from torpor.runtime.registry import Registry

__all__ = ["TaskCards", "TaskHandle"]


class TaskCards:
    """The runtime's side of every :class:`TaskHandle`: logging and reading cards."""

    __slots__ = ("_conversations", "_host", "_registry", "_supervisor")

    def __init__(
        self,
        *,
        conversations: Conversations,
        host: AgentHost,
        registry: Registry,
        supervisor: Starter,
    ) -> None:
        self._conversations = conversations
        self._host = host
        self._registry = registry
        self._supervisor = supervisor

    async def update(self, conversation_id: str, patch: dict[str, Any]) -> TaskCard:
        self._conversations.check_open()
        merged_card(None, **patch)  # bad fields fail here, before any agent is woken
        agent = self._conversations.agent(conversation_id)
        if agent.state is AgentState.PARKED:
            raise AgentParked(conversation_id, agent.parked_cause or "parked")
        # The actor logs it (it reads its mailbox in every state, a turn running included),
        # so a change is ordered with the turn's own writes by the one writer.
        done: asyncio.Future[Event] = asyncio.get_running_loop().create_future()
        agent.post(CardRequest(patch, done))
        self._registry.unqueue(agent)
        self._supervisor.ensure_running(agent)
        event = await done
        assert isinstance(event.body, TaskCard)
        return event.body

    async def get(self, conversation_id: str) -> TaskCard | None:
        self._conversations.check_open()
        agent = self._registry.get(conversation_id)
        if agent is not None and agent.ws is not None:
            return card_of(agent)
        resume = await self._host.store.resume(conversation_id)
        found: Event | None = resume.checkpoint.task_card if resume.checkpoint else None
        for event in resume.events:
            if type(event.body) is TaskCard and (found is None or event.position > found.position):
                found = event
        return found.body if found is not None and isinstance(found.body, TaskCard) else None


class TaskHandle:
    """One conversation's task card (see README "The task card").

    ``await update(goal=..., constraints=..., open_loops=..., key_positions=...)``
    logs the card with the given fields replaced (None: unchanged) and returns it;
    ``await get()`` returns the card in effect (None: none set), never waking the
    agent. A change made while a turn runs is logged at once and is in effect
    from that turn's next model call.
    """

    __slots__ = ("_cards", "conversation_id")

    def __init__(self, cards: TaskCards, conversation_id: str) -> None:
        self._cards = cards
        self.conversation_id = conversation_id

    def __repr__(self) -> str:
        return f"TaskHandle({self.conversation_id!r})"

    async def update(
        self,
        *,
        goal: str | None = None,
        constraints: list[str] | tuple[str, ...] | None = None,
        open_loops: list[str] | tuple[str, ...] | None = None,
        key_positions: list[int] | tuple[int, ...] | None = None,
    ) -> TaskCard:
        """Log a card change; the card now in effect.

        Raises InvalidInput for a bad field and TaskCardTooLarge when the card
        would exceed ``AgentConfig.task_card_tokens`` (nothing is logged either
        way), AgentParked for a parked agent, StoreUnavailable when the store
        cannot write. Starts the conversation if it has no events yet.
        """
        patch: dict[str, Any] = {
            name: value
            for name, value in (
                ("goal", goal),
                ("constraints", constraints),
                ("open_loops", open_loops),
                ("key_positions", key_positions),
            )
            if value is not None
        }
        return await self._cards.update(self.conversation_id, patch)

    async def get(self) -> TaskCard | None:
        """The card in effect (None: none was ever set). Read from the log when the agent
        is not live: the latest fold's card, or a later one logged since."""
        return await self._cards.get(self.conversation_id)
