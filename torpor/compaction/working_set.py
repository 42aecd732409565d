"""An agent's working set: the latest checkpoint and the verbatim tail of the log since it.

This is the bounded store of the design: a projection of the log, never a
second copy of history. It is per agent and per live conversation, so it is
kept lean: the checkpoint, the tail's events (shared with the store's
objects, not copied), their summed token count, the rendered handoff text and
each event's topic candidates (small, for the next fold's marker).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from torpor.compaction.markers import Hints, event_hints, handoff_text
from torpor.compaction.recipe import Recipe, Rendered, decode_recipe, encode_recipe
from torpor.compaction.render import materialize, plan
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

    __slots__ = ("_checkpoint", "_handoff", "_hints", "_tail", "_tail_tokens", "conversation_id")

    def __init__(
        self,
        conversation_id: str,
        checkpoint: Checkpoint | None,
        events: Sequence[Event] = (),
    ) -> None:
        self.conversation_id = conversation_id
        self._checkpoint: Checkpoint | None = None
        self._handoff: tuple[str, int] | None = None
        self._tail: list[Event] = []
        self._hints: list[Hints | None] = []
        self._tail_tokens = 0
        if checkpoint is not None:
            self.apply(checkpoint)
            start = checkpoint.position
            events = [e for e in events if e.position >= start]
        self._extend(events, extract=False)

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
            out.append(known)
        return out

    # --- changing --------------------------------------------------------------------

    def append(self, events: Iterable[Event]) -> None:
        """Add newly logged events (positions must keep increasing)."""
        self._extend(events, extract=True)

    def _extend(self, events: Iterable[Event], *, extract: bool) -> None:
        tail = self._tail
        last = tail[-1].position if tail else -1
        if self._checkpoint is not None:
            last = max(last, self._checkpoint.position - 1)
        for event in events:
            if event.position <= last:
                raise ValueError(
                    f"event at position {event.position} does not follow {last} "
                    f"in conversation {self.conversation_id!r}"
                )
            last = event.position
            tail.append(event)
            self._hints.append(event_hints(event) if extract else None)
            self._tail_tokens += event.tokens

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
            self._tail_tokens -= sum(e.tokens for e in tail[:cut])
            del tail[:cut]
            del self._hints[:cut]
        self._checkpoint = checkpoint
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
        """
        encoding = policy.encoding
        if self._handoff is None:
            self._handoff = handoff_tokens(self._checkpoint, encoding)
        text, tokens = self._handoff
        decisions = plan(self._tail, system_prompt, tokens, policy, tools, calibration)
        return materialize(
            self._tail, self._checkpoint, text, tokens, system_prompt, tools, decisions, encoding
        )

    # --- accounting ------------------------------------------------------------------

    def estimated_bytes(self) -> int:
        """Roughly what this working set keeps alive (objects it holds, strings included)."""
        size = sys.getsizeof(self) + sys.getsizeof(self._tail) + sys.getsizeof(self._hints)
        for event in self._tail:
            size += _event_bytes(event)
        for flat in self._hints:
            if flat:
                size += sys.getsizeof(flat)
                size += sum(sys.getsizeof(x) for x in flat if isinstance(x, str))
        if self._checkpoint is not None:
            size += _checkpoint_bytes(self._checkpoint)
        if self._handoff is not None and self._handoff[0]:
            size += sys.getsizeof(self._handoff[0])
        return size


def _event_bytes(event: Event) -> int:
    size = sys.getsizeof(event) + sys.getsizeof(event.body)
    for value in (event.position, event.tokens, event.created_at):
        size += sys.getsizeof(value) if value > 256 else 0
    body = event.body
    if isinstance(body, UserMessage):
        size += sys.getsizeof(body.text)
    elif isinstance(body, AssistantMessage):
        size += sys.getsizeof(body.text)
        if body.tool_calls:
            size += sys.getsizeof(body.tool_calls)
            for call in body.tool_calls:
                size += sys.getsizeof(call) + sys.getsizeof(call.id) + sys.getsizeof(call.name)
                size += _deep(call.arguments)
    elif isinstance(body, ToolResult):
        size += sys.getsizeof(body.content) + sys.getsizeof(body.call_id)
        if body.artifact is not None:
            size += sys.getsizeof(body.artifact)
    elif isinstance(body, Aborted):
        size += sys.getsizeof(body.partial_text) + sys.getsizeof(body.detail)
    return size


def _deep(value: object) -> int:
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        for k, v in value.items():
            size += _deep(k) + _deep(v)
    elif isinstance(value, list | tuple):
        for v in value:
            size += _deep(v)
    return size


def _checkpoint_bytes(checkpoint: Checkpoint) -> int:
    size = sys.getsizeof(checkpoint) + sys.getsizeof(checkpoint.markers)
    size += sys.getsizeof(checkpoint.summary)
    for marker in checkpoint.markers:
        size += sys.getsizeof(marker) + sys.getsizeof(marker.topics)
        size += sum(sys.getsizeof(t) for t in marker.topics)
    return size
