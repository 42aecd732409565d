"""Rebuilding what a model call was sent, from the log and the call's recipe.

The audit row keeps a recipe (positions and decisions) and a hash, not the
text. Replaying the recipe against the log must reproduce the hash; if it
does not, something rewrote history or the prompt/tools changed since.
"""

from __future__ import annotations

from collections.abc import Sequence

from torpor._logging import get_logger
from torpor.compaction.order import up_to_turn
from torpor.compaction.policy import CompactionPolicy
from torpor.compaction.push import recalled_block
from torpor.compaction.recipe import Recipe, Rendered, text_hash
from torpor.compaction.render import decisions_of, materialize
from torpor.compaction.sections import head_of
from torpor.compaction.task_card import card_text, card_tokens
from torpor.compaction.working_set import handoff_tokens
from torpor.errors import StoreError
from torpor.events import Event, Redacted, TaskCard, presented
from torpor.llm.protocol import ToolSpec
from torpor.store.protocol import Checkpoint, EventStore

__all__ = ["rebuild_rendered", "redacted_since"]

log = get_logger(__name__)


async def rebuild_rendered(
    store: EventStore,
    conversation_id: str,
    recipe: Recipe,
    system_prompt: str,
    policy: CompactionPolicy,
    tools: Sequence[ToolSpec] = (),
    *,
    redacted: bool = False,
) -> Rendered:
    """The context a recipe describes, rebuilt from the log (compare ``.hash`` to the call's).

    Reads the checkpoint the recipe names and the tail range; applies the
    recorded stubs, clips and drops. ``policy`` is not re-applied: the recipe's
    decisions are, so a later policy change does not alter the replay. The hash
    is computed as the recipe's version did, so calls recorded before the hash
    chain still verify. ``redacted``: events were redacted since the call, so the
    checkpoint it names may be gone with them (a fold that covered one): rebuilt
    without its handoff (the hash cannot match; the redaction is why).
    """
    bound = log.bind(conversation_id=conversation_id)
    checkpoint: Checkpoint | None = None
    if recipe.checkpoint_position is not None:
        for candidate in await store.checkpoints(conversation_id):
            if candidate.position == recipe.checkpoint_position and candidate.cycle == recipe.cycle:
                checkpoint = candidate
        if checkpoint is None and not redacted:
            raise StoreError(
                f"conversation {conversation_id!r} has no checkpoint at position "
                f"{recipe.checkpoint_position} (cycle {recipe.cycle})"
            )
    events: list[Event] = []
    if recipe.tail_start is not None and recipe.tail_end is not None:
        events = [presented(e) for e in
                  await store.read_range(conversation_id, recipe.tail_start, recipe.tail_end)]
        if recipe.turn is not None:
            events = up_to_turn(events, recipe.turn)
    if text_hash(system_prompt) != recipe.system_hash:
        bound.warning("rebuild_system_prompt_differs")
    if tuple(t.name for t in tools) != recipe.tools:
        bound.warning("rebuild_tools_differ", recorded=recipe.tools)
    encoding = recipe.encoding or policy.encoding
    text, tokens = handoff_tokens(checkpoint, encoding)
    card = await _card_at(store, conversation_id, recipe.task_card)
    pushed = [
        await _one(store, conversation_id, position) for position, _ in recipe.pushed
    ]
    recalled = recalled_block(pushed, [keep for _, keep in recipe.pushed], encoding)
    return materialize(
        events,
        checkpoint,
        head_of({
            "task_card": (card_text(card), card_tokens(card, encoding)),
            "markers": (text, tokens),
        }),
        system_prompt,
        tools,
        decisions_of(recipe),
        encoding,
        recipe.version,  # the hash format the call recorded (1: one sha256, 2: the chain)
        recalled=recalled,
        task_card=recipe.task_card,
        pushed=recipe.pushed,
    )


async def _one(store: EventStore, conversation_id: str, position: int) -> Event:
    found = await store.read_range(conversation_id, position, position)
    if not found:
        raise StoreError(f"conversation {conversation_id!r} has no event at {position}")
    return presented(found[0])


async def _card_at(
    store: EventStore, conversation_id: str, position: int | None
) -> TaskCard | None:
    """The task card a recipe names (its event's position), read back from the log."""
    if position is None:
        return None
    body = (await _one(store, conversation_id, position)).body
    if not isinstance(body, TaskCard):
        raise StoreError(
            f"conversation {conversation_id!r}: position {position} is not a task card"
        )
    return body


async def redacted_since(
    store: EventStore, conversation_id: str, recipe: Recipe, since: int
) -> tuple[int, ...]:
    """Positions a call's context drew on (folded or in its tail) redacted at or after
    ``since`` (the call's time, epoch ms): why its rebuild differs from what it was sent."""
    high = max(
        recipe.tail_end if recipe.tail_end is not None else -1,
        recipe.checkpoint_position - 1 if recipe.checkpoint_position is not None else -1,
        *(position for position, _ in recipe.pushed),
    )
    if high < 0:
        return ()
    found: list[int] = []
    for event in await store.read_range(conversation_id, 0, high):
        body = event.body
        if type(body) is Redacted and body.at >= since:
            found.append(event.position)
    return tuple(found)
