"""Synthetic conversation history, written straight through the store in bulk.

The load test needs N conversations with M events each before any agent
exists. Going through the runtime would pay for a model call per turn; the
store's group commit instead takes many conversations' appends into one
transaction, so building 200,000 events is a matter of seconds.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence

import msgspec

from torpor.compaction.markers import encode_hints
from torpor.compaction.tokens import make_token_counter
from torpor.events import AssistantMessage, Body, UserMessage
from torpor.store import open_store

__all__ = ["BuildFigures", "build_history", "turns_for"]

_TOPICS = (
    "the invoice", "a refund", "the delivery date", "my password", "the API quota",
    "the quarterly report", "a flight to Lisbon", "the database migration", "the weekly meeting",
    "a broken build", "the garden shed", "an insurance claim", "the new laptop", "a tax form",
)
_ASKS = (
    "Can you help me with {t}?", "What is the status of {t}?", "Please summarise {t} for me.",
    "I have a question about {t} again.", "Is there any news on {t} today?",
)
_ANSWERS = (
    "Here is what I found about {t}: it was updated yesterday and needs one more review.",
    "Regarding {t}, the last change went through and nothing else is pending right now.",
    "I checked {t}; two items are open, and the oldest one is waiting on a reply from you.",
    "For {t} the usual steps apply: confirm the details, then submit, then wait a day.",
)


class BuildFigures(msgspec.Struct, frozen=True):
    conversations: int
    events: int
    seconds: float
    events_per_second: float


def _pool(seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    asks = [rng.choice(_ASKS).format(t=t) for t in _TOPICS for _ in range(8)]
    answers = [rng.choice(_ANSWERS).format(t=t) for t in _TOPICS for _ in range(8)]
    return asks, answers


def turns_for(history: int, index: int, pool: tuple[list[str], list[str]]) -> list[list[Body]]:
    """``history`` events for conversation ``index``, grouped by turn, ending on a reply.

    Every turn is a question and its answer; an odd count opens with a greeting
    (turn 0) so that no conversation is left with an unanswered message, which
    revival would have to mark as interrupted.
    """
    asks, answers = pool
    turns: list[list[Body]] = []
    if history % 2:
        turns.append([AssistantMessage("Hello! How can I help you today?")])
    for k in range(history // 2):
        pick = index * 7 + k
        turns.append(
            [UserMessage(asks[pick % len(asks)]), AssistantMessage(answers[pick % len(answers)])]
        )
    return turns


async def build_history(
    url: str,
    conversation_ids: Sequence[str],
    history: int,
    *,
    on_conversation: Callable[[], None] = lambda: None,
    concurrency: int = 512,
    seed: int = 0,
) -> BuildFigures:
    """Append ``history`` events to each conversation, many conversations at once."""
    pool = _pool(seed)
    counter = make_token_counter()
    started = time.perf_counter()
    async with open_store(url, token_counter=counter, hint_extractor=encode_hints) as store:
        queue = iter(enumerate(conversation_ids))

        async def worker() -> None:
            for index, conversation_id in queue:
                first_turn = 0 if history % 2 else 1
                for offset, bodies in enumerate(turns_for(history, index, pool)):
                    await store.append(conversation_id, bodies, turn=first_turn + offset)
                on_conversation()

        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, max(1, len(conversation_ids)))):
                group.create_task(worker())
    seconds = time.perf_counter() - started
    events = history * len(conversation_ids)
    return BuildFigures(
        conversations=len(conversation_ids),
        events=events,
        seconds=seconds,
        events_per_second=events / seconds if seconds > 0 else 0.0,
    )
