"""Conversations whose words are common: the flood of bench/needles.py, but on topic.

The flood repeats the words a person's questions use (``billing``, ``cutover``,
``service``, ``payments``) in long, repetitive answers and short user messages,
so bm25 gives those words almost no weight and long events hold them many times:
what issue 25 measured (a short fact holding every query word ranked below them).
"""

from __future__ import annotations

import random

from torpor.events import AssistantMessage, Body, UserMessage

__all__ = ["FACT", "flood", "topical_conversation"]

FACT = "The billing cutover is owned by Dana Whitfield."


def _words(text: str) -> list[str]:
    return text.split()


_COMMON = _words(
    "the billing service and the cutover plan for the billing queue so we moved the "
    "billing jobs before the cutover window while the team watched billing errors"
)
_OTHER = _words(
    "ledger search gateway ingest auth mailer report retry backoff deploy release "
    "dashboard alert rollback schema migration staging traffic payments"
)


def flood(rng: random.Random, words: int) -> str:
    """Filler prose: half of its words from the topic's common words, repeated."""
    return " ".join(rng.choice(_COMMON if rng.random() < 0.5 else _OTHER)
                    for _ in range(words))


def topical_conversation(
    events: int, facts: dict[int, Body], seed: int = 3
) -> list[list[Body]]:
    """``events`` events as turns (a user message of ~30 words, an answer of 60 or 250),
    with ``facts[position]`` in place of the flood at that position."""
    rng = random.Random(seed)
    turns: list[list[Body]] = []
    for position in range(events):
        body = facts.get(position)
        if body is None:
            if position % 2 == 0:
                body = UserMessage(flood(rng, 30))
            else:
                body = AssistantMessage(flood(rng, rng.choice((60, 250))))
        if position % 2 == 0:
            turns.append([body])
        else:
            turns[-1].append(body)
    return turns
