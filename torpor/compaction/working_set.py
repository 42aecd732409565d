"""An agent's working set: the latest checkpoint and the verbatim tail of the log since it.

This is the bounded store of the design: a projection of the log, never a
second copy of history. It is per agent and per live conversation, so it is
kept lean: the checkpoint, the tail's events (shared with the store's
objects, not copied), their summed token count, the rendered handoff text,
each event's topic candidates (small, for the next fold's marker) and the
render cache (:mod:`torpor.compaction.incremental`: the rendered tail, whose
messages are the events' own bodies plus small stubs).

Everything the actor asks for on every call is kept up to date as events
arrive, so a model call and a turn cost O(new events), not O(tail): token and
byte totals are running sums, and the rendered tail is extended, not redone.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from torpor.compaction.footprint import (
    checkpoint_bytes,
    event_bytes,
    hints_bytes,
    str_bytes,
    tail_bytes,
)
from torpor.compaction.incremental import TailCache
from torpor.compaction.markers import Hints, event_hints, handoff_text
from torpor.compaction.order import in_turn_order
from torpor.compaction.recipe import Recipe, Rendered, decode_recipe, encode_recipe
from torpor.compaction.render import ceiling_of, materialize, plan
from torpor.compaction.tokens import MESSAGE_OVERHEAD, count_cached
from torpor.events import Aborted, AssistantMessage, Event, ToolResult, UserMessage
from torpor.llm.protocol import ToolSpec

if TYPE_CHECKING:
    from torpor.compaction.policy import CompactionPolicy
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
    position (what ``store.resume()`` returns). Topic candidates are extracted
    when an event is appended live, or on the first fold that needs them after
    a revival; either way the same function of the same event, so a revived
    agent folds exactly as a live one would.
    """

    __slots__ = (
        "_cache",
        "_checkpoint",
        "_checkpoint_bytes",
        "_event_bytes",
        "_handoff",
        "_hint_bytes",
        "_hints",
        "_tail",
        "_tail_tokens",
        "conversation_id",
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
        self._hints: list[Hints | None] = []
        self._tail_tokens = 0
        self._event_bytes = 0  # running sums behind estimated_bytes()
        self._hint_bytes = 0
        self._checkpoint_bytes = 0
        self._cache: TailCache | None = None  # made on the first render, dropped on a fold
        if checkpoint is not None:
            self.apply(checkpoint)
            start = checkpoint.position
            events = [e for e in events if e.position >= start]
        self._extend(in_turn_order(events), extract=False)

    # --- reading ---------------------------------------------------------------------

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self._checkpoint

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
        """Topic candidates of tail[start:stop], extracting any not yet known."""
        out: list[Hints] = []
        hints = self._hints
        for i in range(start, stop):
            known = hints[i]
            if known is None:
                known = hints[i] = event_hints(self._tail[i])
                self._hint_bytes += hints_bytes(known)
            out.append(known)
        return out

    # --- changing --------------------------------------------------------------------

    def append(self, events: Iterable[Event]) -> None:
        """Add newly logged events, in turn order (see :mod:`torpor.compaction.order`)."""
        self._extend(events, extract=True)

    def _extend(self, events: Iterable[Event], *, extract: bool) -> None:
        tail = self._tail
        # Turn order (see compaction.order): turns never go back, and nothing lands
        # at or before the checkpoint; a postponed user message may have a lower
        # position than the end of the turn before it.
        last_turn = tail[-1].turn if tail else 0
        last = tail[-1].position if tail else -1
        if self._checkpoint is not None:
            last = max(last, self._checkpoint.position - 1)
        for event in events:
            postponed = event.turn > last_turn and type(event.body) is UserMessage
            if event.turn < last_turn or (event.position <= last and not postponed):
                raise ValueError(
                    f"event at position {event.position} (turn {event.turn}) does not follow "
                    f"position {last} (turn {last_turn}) in conversation {self.conversation_id!r}"
                )
            last_turn = event.turn
            last = event.position
            tail.append(event)
            hints = event_hints(event) if extract else None
            self._hints.append(hints)
            self._tail_tokens += event.tokens
            self._event_bytes += event_bytes(event)
            self._hint_bytes += hints_bytes(hints)

    def apply(self, checkpoint: Checkpoint) -> None:
        """Adopt a fold: drop tail events before its position, keep the rest."""
        if self._checkpoint is not None and checkpoint.position < self._checkpoint.position:
            raise ValueError(
                f"checkpoint at {checkpoint.position} is older than the current one "
                f"at {self._checkpoint.position}"
            )
        cut = 0
        tail = self._tail
        while cut < len(tail) and tail[cut].position < checkpoint.position:
            cut += 1
        if cut:
            del tail[:cut]
            del self._hints[:cut]
            # Recounted over what is kept (a fold keeps a few turns): no drift, no O(cut).
            self._tail_tokens = sum(e.tokens for e in tail)
            self._event_bytes, self._hint_bytes = tail_bytes(tail, self._hints)
            self._cache = None  # slot indices moved; rebuilt from the kept tail on next render
        self._checkpoint = checkpoint
        self._checkpoint_bytes = checkpoint_bytes(checkpoint)
        self._handoff = None  # rendered on the next assembly (it needs the policy's encoding)

    # --- assembling ------------------------------------------------------------------

    def render(
        self,
        system_prompt: str,
        policy: CompactionPolicy,
        tools: Sequence[ToolSpec] = (),
        *,
        calibration: float = 1.0,
    ) -> Rendered:
        """The context for the next model call: system prompt, handoff, rendered tail.

        Deterministic in (checkpoint, tail, prompt, policy, tools); never above
        the policy's hard ceiling. ``calibration``: reported / estimated prompt
        tokens seen for this conversation; above 1 it tightens the ceiling.

        The same bytes as :meth:`render_from_scratch`, at O(events since the last
        call): the rendered tail is kept and extended (see
        :mod:`torpor.compaction.incremental`). Only a context over the ceiling,
        whose cuts depend on the whole tail, is planned from scratch.
        """
        encoding = policy.encoding
        text, tokens = self._handoff_for(encoding)
        limit = policy.clip_limit
        keep = policy.keep_tool_results
        cache = self._cache
        if cache is None or not cache.fits(encoding, limit, keep):
            cache = self._cache = TailCache(encoding, limit, keep)
        cache.advance(self._tail)
        rendered = cache.render(
            self._tail,
            self._checkpoint,
            text,
            tokens,
            system_prompt,
            tools,
            ceiling_of(policy, calibration),
        )
        if rendered is not None:
            return rendered
        return self.render_from_scratch(system_prompt, policy, tools, calibration=calibration)

    def render_from_scratch(
        self,
        system_prompt: str,
        policy: CompactionPolicy,
        tools: Sequence[ToolSpec] = (),
        *,
        calibration: float = 1.0,
    ) -> Rendered:
        """:meth:`render` by planning and materializing the whole tail (no cache used or kept)."""
        encoding = policy.encoding
        text, tokens = self._handoff_for(encoding)
        decisions = plan(self._tail, system_prompt, tokens, policy, tools, calibration)
        return materialize(
            self._tail, self._checkpoint, text, tokens, system_prompt, tools, decisions, encoding
        )

    def _handoff_for(self, encoding: str) -> tuple[str, int]:
        handoff = self._handoff
        if handoff is None or handoff[2] != encoding:
            text, tokens = handoff_tokens(self._checkpoint, encoding)
            handoff = self._handoff = (text, tokens, encoding)
        return handoff[0], handoff[1]

    # --- accounting ------------------------------------------------------------------

    def estimated_bytes(self) -> int:
        """Roughly what this working set keeps alive (objects it holds, strings included).

        O(1): per-event sizes are summed as events arrive (the actor asks after
        every turn). Includes the render cache's own objects; shared ones
        (event bodies reused as messages) are counted once, with the events.
        """
        size = self._fixed_bytes() + self._event_bytes + self._hint_bytes
        if self._cache is not None:
            size += self._cache.footprint()
        return size

    def walk_bytes(self) -> int:
        """:meth:`estimated_bytes` counted from scratch over every object (for tests)."""
        events, hints = tail_bytes(self._tail, self._hints)
        size = self._fixed_bytes() + events + hints
        if self._cache is not None:
            size += self._cache.walk_footprint(self._tail)
        return size

    def _fixed_bytes(self) -> int:
        size = sys.getsizeof(self) + sys.getsizeof(self._tail) + sys.getsizeof(self._hints)
        size += self._checkpoint_bytes
        if self._handoff is not None and self._handoff[0]:
            size += str_bytes(self._handoff[0])
        return size
