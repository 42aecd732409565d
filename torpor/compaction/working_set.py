"""An agent's working set: the latest checkpoint and the verbatim tail of the log since it.

This is the bounded store of the design: a projection of the log, never a
second copy of history. It is per agent and per live conversation, so it is
kept lean: the checkpoint, the tail's events (shared with the store's
objects, not copied), their summed token count, the rendered handoff text,
where a fold may cut (one small integer per turn) and the render cache
(:mod:`torpor.compaction.incremental`: the rendered tail, whose messages are
the events' own bodies plus small stubs).

Everything the actor asks for on every call is kept up to date as events
arrive, so a model call and a turn cost O(new events), not O(tail): token and
byte totals are running sums, the rendered tail is extended, not redone, and
so are the fold's cut points. A fold reads each folded event's topic hints as
the store kept them at append (:func:`~torpor.compaction.markers.encode_hints`),
so the first fold after a revival costs what a live agent's fold costs.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from torpor.compaction.footprint import checkpoint_bytes, event_bytes, str_bytes, tail_bytes
from torpor.compaction.incremental import TailCache
from torpor.compaction.markers import Hints, handoff_text, span_hints
from torpor.compaction.order import in_turn_order
from torpor.compaction.recipe import Recipe, Rendered, decode_recipe, encode_recipe
from torpor.compaction.render import ceiling_of, materialize, plan
from torpor.compaction.sections import Block, head_of, head_tokens
from torpor.compaction.task_card import card_text, card_tokens
from torpor.compaction.tokens import MESSAGE_OVERHEAD, count_cached
from torpor.events import Aborted, AssistantMessage, Event, TaskCard, ToolResult, UserMessage
from torpor.llm.protocol import ToolSpec

if TYPE_CHECKING:
    from torpor.compaction.policy import CompactionPolicy
    from torpor.compaction.push import Pushed
    from torpor.store.protocol import Checkpoint

__all__ = [
    "Recipe",
    "Rendered",
    "WorkingSet",
    "decode_recipe",
    "encode_recipe",
    "handoff_tokens",
]


def handoff_tokens(checkpoint: Checkpoint | None, encoding: str) -> tuple[str, int]:
    """The handoff text a checkpoint renders to and its token cost (stored, or counted once)."""
    if checkpoint is None:
        return "", 0
    text = handoff_text(checkpoint)
    if not text:
        return "", 0
    if checkpoint.tokens > 0:
        return text, checkpoint.tokens
    return text, count_cached(text, encoding) + MESSAGE_OVERHEAD


class WorkingSet:
    """Latest checkpoint + events since, with what assembly and folding need at hand.

    ``events`` given to the constructor are those at or after the checkpoint's
    position (what ``store.resume()`` returns). Topic candidates come from the
    events themselves (stored at append, or extracted when a fold needs them for
    an event that has none stored): the same function of the same event either
    way, so a revived agent folds exactly as a live one would.
    """

    __slots__ = (
        "_cache",
        "_card",
        "_card_block",
        "_checkpoint",
        "_checkpoint_bytes",
        "_event_bytes",
        "_handoff",
        "_head_memo",
        "_high",
        "_starts",
        "_tail",
        "_tail_tokens",
        "conversation_id",
        "push_memo",
    )

    def __init__(
        self,
        conversation_id: str,
        checkpoint: Checkpoint | None,
        events: Sequence[Event] = (),
    ) -> None:
        self.conversation_id = conversation_id
        self._checkpoint: Checkpoint | None = None
        self._handoff: tuple[str, int, str] | None = None  # text, tokens, encoding
        self._tail: list[Event] = []
        self._tail_tokens = 0
        self._event_bytes = 0  # running sum behind estimated_bytes()
        self._checkpoint_bytes = 0
        self._starts = array("q")  # tail indices where a fold may cut (see fold.turn_starts)
        self._high = -1  # the tail's highest position
        self._cache: TailCache | None = None  # made on the first render, dropped on a fold
        self._card: Event | None = None  # the latest TaskCard event seen (by position)
        self._card_block: tuple[str, int, str] | None = None  # text, tokens, encoding
        # The head blocks made from the card block and handoff they were made from: the
        # same tuple while neither changes, so a render can tell them unchanged by identity.
        self._head_memo: tuple[object, object, tuple[Block, ...]] | None = None
        # The last recalled section pushed and what it was for (see actors.task.pushed_for).
        self.push_memo: tuple[tuple[int, int, int], Pushed] | None = None
        if checkpoint is not None:
            self.apply(checkpoint)
            start = checkpoint.position
            events = [e for e in events if e.position >= start]
        self._extend(in_turn_order(events))

    # --- reading ---------------------------------------------------------------------

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self._checkpoint

    @property
    def card(self) -> Event | None:
        """The task card in effect: the latest :class:`TaskCard` event seen, or None."""
        return self._card

    def note_card(self, event: Event) -> None:
        """A TaskCard event was logged (or found in the log or a checkpoint): the latest
        by position is the card in effect. Never part of the tail: a card is not a turn's
        content, is never folded, and its tokens are its own section's."""
        current = self._card
        if current is None or event.position > current.position:
            self._card = event
            self._card_block = None

    @property
    def tail(self) -> list[Event]:
        """The events since the checkpoint, oldest first. Read it; do not mutate it."""
        return self._tail

    @property
    def tail_tokens(self) -> int:
        return self._tail_tokens

    @property
    def head(self) -> int | None:
        """The last position this working set knows of (None if it knows none)."""
        if self._tail:
            return self._tail[-1].position
        if self._checkpoint is not None and self._checkpoint.position > 0:
            return self._checkpoint.position - 1
        return None

    @property
    def last_turn(self) -> int:
        return self._tail[-1].turn if self._tail else 0

    def pending_calls(self) -> tuple[str, ...]:
        """Ids of the last assistant message's tool calls that have no result yet.

        Empty if the turn ended since (a user message or an abort came after it).
        """
        answered: set[str] = set()
        for event in reversed(self._tail):
            body = event.body
            if isinstance(body, ToolResult):
                answered.add(body.call_id)
            elif isinstance(body, AssistantMessage):
                return tuple(c.id for c in body.tool_calls if c.id not in answered)
            elif isinstance(body, UserMessage | Aborted):
                return ()
        return ()

    def hints(self, start: int, stop: int) -> list[Hints]:
        """Topic candidates of tail[start:stop] as a fold ranks them (see :func:`span_hints`):
        as stored at append, else extracted now."""
        return span_hints(self._tail[start:stop])

    def turn_starts(self) -> list[int]:
        """Tail indices where a fold may cut, ascending: :func:`~torpor.compaction.fold.
        turn_starts` of the tail, kept up to date as events arrive instead of walked."""
        return self._starts.tolist()

    # --- changing --------------------------------------------------------------------

    def append(self, events: Iterable[Event]) -> None:
        """Add newly logged events, in turn order (see :mod:`torpor.compaction.order`)."""
        self._extend(events)

    def _extend(self, events: Iterable[Event]) -> None:
        tail = self._tail
        starts = self._starts
        # Turn order (see compaction.order): turns never go back, and nothing lands
        # at or before the checkpoint; a postponed user message may have a lower
        # position than the end of the turn before it.
        last_turn = tail[-1].turn if tail else 0
        last = tail[-1].position if tail else -1
        if self._checkpoint is not None:
            last = max(last, self._checkpoint.position - 1)
        high = self._high
        tokens = self._tail_tokens
        size = self._event_bytes
        try:
            for event in events:
                position = event.position
                kind = type(event.body)
                if kind is TaskCard:
                    self.note_card(event)
                    continue
                postponed = event.turn > last_turn and kind is UserMessage
                if event.turn < last_turn or (position <= last and not postponed):
                    raise ValueError(
                        f"event at position {position} (turn {event.turn}) does not follow "
                        f"position {last} (turn {last_turn}) in conversation "
                        f"{self.conversation_id!r}"
                    )
                last_turn = event.turn
                last = position
                # Where a fold may cut, as fold.turn_starts says, one event at a time:
                # a cut must split the tail by position (a lower position arriving
                # now undoes the cuts above it) and must not separate a tool call
                # from a result (a result undoes the cuts after its call).
                while starts and tail[starts[-1]].position > position:
                    starts.pop()
                if kind is ToolResult and starts:
                    issued = _issuer(tail, event.body.call_id)  # type: ignore[union-attr]
                    while starts and starts[-1] > issued >= 0:
                        starts.pop()
                elif kind is UserMessage and tail and high < position:
                    starts.append(len(tail))
                if position > high:
                    high = position
                tail.append(event)
                tokens += event.tokens
                size += event_bytes(event)
        finally:  # a refused event leaves the ones before it added and counted
            self._high = high
            self._tail_tokens = tokens
            self._event_bytes = size

    def apply(self, checkpoint: Checkpoint) -> None:
        """Adopt a fold: drop tail events before its position, keep the rest."""
        if self._checkpoint is not None and checkpoint.position < self._checkpoint.position:
            raise ValueError(
                f"checkpoint at {checkpoint.position} is older than the current one "
                f"at {self._checkpoint.position}"
            )
        tail = self._tail
        cut = self._cut_at(checkpoint.position)
        if cut:
            kept = tail[cut:]
            # Recounted over what is kept (a fold keeps a few turns): no drift, no O(cut).
            tail.clear()
            self._tail_tokens = self._event_bytes = 0
            self._starts = array("q")
            self._high = -1
            self._extend(kept)
            self._cache = None  # slot indices moved; rebuilt from the kept tail on next render
        self._checkpoint = checkpoint
        if checkpoint.task_card is not None:
            self.note_card(checkpoint.task_card)
        self._checkpoint_bytes = checkpoint_bytes(checkpoint)
        self._handoff = None  # rendered on the next assembly (it needs the policy's encoding)

    def _cut_at(self, position: int) -> int:
        """How many tail events come before the first one at or after ``position``."""
        tail = self._tail
        starts = self._starts
        # A fold cuts at a turn start: every event before it is below its position.
        lo, hi = 0, len(starts)
        while lo < hi:
            mid = (lo + hi) // 2
            if tail[starts[mid]].position < position:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(starts) and tail[starts[lo]].position == position:
            return starts[lo]
        cut = 0  # any other position (an arbitrary checkpoint): walk
        while cut < len(tail) and tail[cut].position < position:
            cut += 1
        return cut

    # --- assembling ------------------------------------------------------------------

    def render(
        self,
        system_prompt: str,
        policy: CompactionPolicy,
        tools: Sequence[ToolSpec] = (),
        *,
        calibration: float = 1.0,
        recalled: Block | None = None,
        pushed: tuple[tuple[int, int], ...] = (),
    ) -> Rendered:
        """The context for the next model call, in the order of
        :mod:`torpor.compaction.sections`: system prompt, task card, handoff, rendered
        tail, and the ``recalled`` section pushed for this call (``pushed``: its
        positions and the tokens each kept, for the recipe).

        Deterministic in (card, checkpoint, tail, prompt, policy, tools, recalled);
        never above the policy's hard ceiling. ``calibration``: reported / estimated
        prompt tokens seen for this conversation; above 1 it tightens the ceiling.

        The same bytes as :meth:`render_from_scratch`, at O(events since the last
        call): the rendered tail is kept and extended (see
        :mod:`torpor.compaction.incremental`). Only a context over the ceiling,
        whose cuts depend on the whole tail, is planned from scratch.
        """
        encoding = policy.encoding
        head = self._head(encoding)
        limit = policy.clip_limit
        keep = policy.keep_tool_results
        clear = policy.clear_at_least
        cache = self._cache
        if cache is None or not cache.fits(encoding, limit, keep, clear):
            cache = self._cache = TailCache(encoding, limit, keep, clear)
        cache.advance(self._tail)
        card = self._card.position if self._card is not None else None
        rendered = cache.render(
            self._tail,
            self._checkpoint,
            head,
            system_prompt,
            tools,
            ceiling_of(policy, calibration),
            recalled=recalled,
            task_card=card,
            pushed=pushed,
        )
        if rendered is not None:
            return rendered
        return self.render_from_scratch(
            system_prompt, policy, tools, calibration=calibration, recalled=recalled,
            pushed=pushed,
        )

    def render_from_scratch(
        self,
        system_prompt: str,
        policy: CompactionPolicy,
        tools: Sequence[ToolSpec] = (),
        *,
        calibration: float = 1.0,
        recalled: Block | None = None,
        pushed: tuple[tuple[int, int], ...] = (),
    ) -> Rendered:
        """:meth:`render` by planning and materializing the whole tail (no cache used or kept)."""
        encoding = policy.encoding
        head = self._head(encoding)
        fixed = head_tokens(head) + (recalled.tokens if recalled is not None else 0)
        decisions = plan(self._tail, system_prompt, fixed, policy, tools, calibration)
        return materialize(
            self._tail, self._checkpoint, head, system_prompt, tools, decisions, encoding,
            recalled=recalled,
            task_card=self._card.position if self._card is not None else None,
            pushed=pushed,
        )

    def _head(self, encoding: str) -> tuple[Block, ...]:
        """The blocks between the system prompt and the tail (see compaction.sections)."""
        handoff = self._handoff_for(encoding)
        block = self._card_block
        if block is None or block[2] != encoding:
            body = self._card.body if self._card is not None else None
            card = body if isinstance(body, TaskCard) else None
            block = self._card_block = (card_text(card), card_tokens(card, encoding), encoding)
        memo = self._head_memo
        if memo is not None and memo[0] is block and memo[1] is handoff:
            return memo[2]
        head = head_of({"task_card": (block[0], block[1]), "markers": (handoff[0], handoff[1])})
        self._head_memo = (block, handoff, head)
        return head

    def _handoff_for(self, encoding: str) -> tuple[str, int, str]:
        handoff = self._handoff
        if handoff is None or handoff[2] != encoding:
            text, tokens = handoff_tokens(self._checkpoint, encoding)
            handoff = self._handoff = (text, tokens, encoding)
        return handoff

    # --- accounting ------------------------------------------------------------------

    def estimated_bytes(self) -> int:
        """Roughly what this working set keeps alive (objects it holds, strings included).

        O(1): per-event sizes are summed as events arrive (the actor asks after
        every turn). Includes the render cache's own objects; shared ones
        (event bodies reused as messages) are counted once, with the events.
        """
        size = self._fixed_bytes() + self._event_bytes
        if self._cache is not None:
            size += self._cache.footprint()
        return size

    def walk_bytes(self) -> int:
        """:meth:`estimated_bytes` counted from scratch over every object (for tests)."""
        size = self._fixed_bytes() + tail_bytes(self._tail)
        if self._cache is not None:
            size += self._cache.walk_footprint(self._tail)
        return size

    def _fixed_bytes(self) -> int:
        size = sys.getsizeof(self) + sys.getsizeof(self._tail) + sys.getsizeof(self._starts)
        size += self._checkpoint_bytes
        if self._handoff is not None and self._handoff[0]:
            size += str_bytes(self._handoff[0])
        if self._card is not None:
            size += event_bytes(self._card)
            if self._card_block is not None:
                size += str_bytes(self._card_block[0])
        return size


def _issuer(tail: Sequence[Event], call_id: str) -> int:
    """Index of the latest assistant message in ``tail`` that issued ``call_id``, or -1.

    Searched backwards: a result nearly always follows its call closely (a result
    for a call the tail does not hold, rare, costs a walk to the start).
    """
    for i in range(len(tail) - 1, -1, -1):
        body = tail[i].body
        if type(body) is AssistantMessage:
            for call in body.tool_calls:
                if call.id == call_id:
                    return i
    return -1
