"""The rendered tail kept between model calls and extended by the events since the last one.

Assembling from scratch (:func:`~torpor.compaction.render.plan` then
``materialize``) walks the whole tail on every call, although between two calls
the tail grows by a few events and an older message's rendering changes only at
a few known moments:

* tool results that left the keep window free enough tokens as stubs (the
  policy's ``clear_at_least``): they become stubs together (and stay stubs);
* a new user message arrives: the previous one is no longer the current ask,
  so it may be clipped now, and it counts as ``tail`` instead of ``user``;
* calls still unanswered get stand-ins, which are final once the turn moves on.

:class:`TailCache` follows exactly those transitions, so a call costs O(new
events) plus copying the message list. The payload hash is a chain over the
messages (:mod:`torpor.compaction.recipe`), carried from call to call: a call
hashes the messages added since the last one, and after a change in the middle
(a stub, a clip) the messages from there on, restarting from a state kept every
:data:`STRIDE` slots (two bytes a slot).

What it produces is byte-for-byte what the full path produces; it is keyed by
the policy numbers its decisions depend on, the working set drops it on a fold
(or when those numbers change) and rebuilds it on the next call. When the
context would exceed the hard ceiling, the one case where the decisions depend
on the whole tail at once, :meth:`TailCache.render` returns None and the caller
takes the full path.

Memory: the message list points at the events' own bodies (shared, never
copied), at stubs and stand-ins (small, made once), and, for clipped messages,
artifact previews and aborted answers, at nothing: it keeps how to rebuild them
(an event index and where the cut falls), because a copy of their text would
nearly double a working set made of large messages.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NamedTuple

from torpor.compaction.context_view import MessageView
from torpor.compaction.footprint import str_bytes
from torpor.compaction.recipe import (
    CHAIN_SEED,
    Recipe,
    Rendered,
    chain,
    chain_end,
    text_hash,
    tools_digest,
)
from torpor.compaction.sections import Block
from torpor.compaction.slots import (
    INTERRUPTED_RESULT,
    clip_keep,
    clip_source,
    clip_text,
    clipped,
    clipped_cost,
    clipped_with,
    freeable,
    stub,
    stub_cost,
    synthetic,
    text_tokens,
    tools_tokens,
    whole,
)
from torpor.events import Aborted, AssistantMessage, Event, ToolCall, ToolResult, UserMessage
from torpor.llm.protocol import ContextMessage, SystemMessage, ToolSpec
from torpor.store.protocol import Checkpoint

__all__ = ["TailCache"]

_WHOLE = -1  # rebuild with whole(event): an artifact preview or an aborted answer
_CUT = -2  # clipped, where the cut falls not located yet (the third field: tokens kept)
_RECLIP = -3  # clipped, and the clip is no prefix of the text: clipped again on every call
_PENDING = SystemMessage("\x00pending")  # a slot rebuilt on every call (never sent)
_REPLACEMENT = "\ufffd"  # what a clip that splits a multi-byte character ends with

# (event index, characters of the source kept or _WHOLE/_CUT/_RECLIP, replacement characters
# or tokens kept)
Rebuild = tuple[int, int, int]

STRIDE = 16
"""Slots between two kept chain states: a change at slot k rehashes from k // STRIDE."""
_CLEAN = sys.maxsize  # no slot changed since the last hash


class TailCache:
    """Rendered slots of one working set's tail under one policy's decisions.

    ``done`` events of the tail are folded in; :meth:`advance` adds the rest.
    Running sums keep the ``tail`` and ``tool_results`` section sizes; the
    current user message and the stand-ins for calls still open are added per
    call, since the next event may change them.
    """

    __slots__ = (
        "clear_at_least",
        "clipped",
        "dirty",
        "done",
        "encoding",
        "hashed",
        "keep_results",
        "last_user",
        "lead_memo",
        "lent",
        "limit",
        "marks",
        "max_position",
        "messages",
        "orphans",
        "overdue_free",
        "owned_bytes",
        "prefix",
        "prefix_state",
        "rebuild",
        "results_tokens",
        "standin_tokens",
        "state",
        "stubbed",
        "synthesized",
        "tail_tokens",
        "tool_names",
        "tools",
        "tools_digest",
        "tools_tokens",
        "unanswered",
        "window",
    )

    def __init__(
        self, encoding: str, limit: int, keep_results: int, clear_at_least: int = 0
    ) -> None:
        self.encoding = encoding
        self.limit = limit
        self.keep_results = keep_results
        self.clear_at_least = clear_at_least
        self.overdue_free = 0  # tokens stubbing the window's results past keep_results frees
        self.done = 0
        self.max_position = -1  # the tail's highest position (not its last: see compaction.order)
        self.messages: list[ContextMessage] = []
        self.lent = False  # a MessageView shares ``messages``: copy it before changing a slot
        self.rebuild: dict[int, Rebuild] = {}  # slot -> how its message is made per call
        self.unanswered: dict[str, ToolCall] = {}
        self.window: list[tuple[int, int]] = []  # (slot, event index) of results not stubbed
        self.last_user = (-1, -1)  # (slot, event index) of the current ask
        # stubbed, orphans, synthesized: made on the first append (most tails never need
        # them, and each empty list is one more object per live agent the cyclic GC walks)
        self.stubbed: list[int] | None = None  # positions, ascending
        self.clipped: dict[int, int] = {}  # position -> tokens kept
        self.orphans: list[int] | None = None  # positions, ascending
        self.synthesized: list[str] | None = None  # call ids of closed stand-ins, in slot order
        self.tail_tokens = 0
        self.results_tokens = 0
        self.owned_bytes = 0  # messages made here (stubs, stand-ins), not shared with events
        self.standin_tokens = text_tokens(INTERRUPTED_RESULT, encoding)
        # The payload hash chain: the state after the system messages (for this prompt
        # and handoff), after the first ``hashed`` slots, and after every STRIDE slots.
        self.prefix: tuple[str, Sequence[Block]] | None = None
        self.prefix_state = CHAIN_SEED
        self.hashed = 0
        self.state = CHAIN_SEED
        self.marks = bytearray()
        self.dirty = _CLEAN  # the lowest slot changed since the last hash
        self.tools: tuple[ToolSpec, ...] = ()  # the last call's specs: their digest and cost
        self.tools_digest = tools_digest(())
        self.tools_tokens = 0
        self.tool_names: tuple[str, ...] = ()
        # The system messages of the last call and what follows from them, made again only
        # when the prompt or the head blocks (not equal: other objects) change: an agent
        # renders with the same prompt and head call after call.
        self.lead_memo: _Lead | None = None

    def fits(self, encoding: str, limit: int, keep_results: int, clear_at_least: int) -> bool:
        """Whether this cache's decisions are the ones a policy with these numbers takes."""
        return (
            encoding == self.encoding
            and limit == self.limit
            and keep_results == self.keep_results
            and clear_at_least == self.clear_at_least
        )

    # --- following the tail ----------------------------------------------------------

    def advance(self, tail: Sequence[Event]) -> None:
        """Fold in the events appended since the last call (the tail only grew since)."""
        if self.done > len(tail):
            raise ValueError("the tail shrank under its render cache")
        for i in range(self.done, len(tail)):
            self._add(tail, i)
            if tail[i].position > self.max_position:
                self.max_position = tail[i].position
        self.done = len(tail)

    def _add(self, tail: Sequence[Event], i: int) -> None:
        # Mirrors slots.layout step by step; each branch also decides the new slot.
        event = tail[i]
        body = event.body
        kind = type(body)
        if kind is ToolResult:
            assert isinstance(body, ToolResult)
            if self.unanswered.pop(body.call_id, None) is not None:
                self._result(tail, i)
            else:
                if self.orphans is None:
                    self.orphans = []
                self.orphans.append(event.position)
        elif kind is UserMessage:
            self._close()
            self._demote_user(tail)
            self.last_user = (len(self.messages), i)
            # A scheduled message is shown marked (slots.whole); a person's, as logged.
            scheduled = body.scheduled is not None  # type: ignore[union-attr]
            self.messages.append(whole(event) if scheduled else body)  # type: ignore[arg-type]
        elif kind is AssistantMessage:
            assert isinstance(body, AssistantMessage)
            self._close()
            self._plain(event, i)
            for call in body.tool_calls:
                self.unanswered[call.id] = call
        elif kind is Aborted:
            assert isinstance(body, Aborted)
            self._close()  # the turn is over: whatever it waited for is not coming
            if body.partial_text:
                self._plain(event, i)

    def _close(self) -> None:
        for call in self.unanswered.values():
            message = synthetic(call)
            self.messages.append(message)
            self.owned_bytes += _owned_size(message)
            self.results_tokens += self.standin_tokens
            if self.synthesized is None:
                self.synthesized = []
            self.synthesized.append(call.id)
        self.unanswered.clear()

    def _plain(self, event: Event, i: int) -> None:
        """An assistant message or an aborted answer: clipped if oversized, else whole."""
        k = len(self.messages)
        if event.tokens > self.limit:
            self.tail_tokens += self._clip(event, i, k)
            return
        self.tail_tokens += event.tokens
        body = event.body
        if type(body) is Aborted:
            self._later(k, (i, _WHOLE, 0))
        else:
            self.messages.append(body)  # type: ignore[arg-type]

    def _demote_user(self, tail: Sequence[Event]) -> None:
        """The current ask is about to be superseded: render it as any older message."""
        k, i = self.last_user
        if k < 0:
            return
        event = tail[i]
        if event.tokens > self.limit:
            self.tail_tokens += self._clip(event, i, k)
        else:
            self.tail_tokens += event.tokens

    def _result(self, tail: Sequence[Event], i: int) -> None:
        event = tail[i]
        body = event.body
        assert isinstance(body, ToolResult)
        k = len(self.messages)
        if event.tokens > self.limit:
            cost = self._clip(event, i, k)
        else:
            cost = event.tokens
            if body.artifact is not None:
                self._later(k, (i, _WHOLE, 0))
            else:
                self.messages.append(body)
        self.results_tokens += cost
        window = self.window
        window.append((k, i))
        keep = self.keep_results
        if len(window) > keep:  # one more result is past the newest `keep`: overdue
            i0 = window[-keep - 1][1]
            self.overdue_free += freeable(tail[i0], self.clipped.get(tail[i0].position),
                                          self.encoding)
            clear = self.clear_at_least
            if clear == 0 or self.overdue_free >= clear:  # worth a change of the prefix
                overdue = len(window) - keep
                for k0, i0 in window[:overdue]:
                    self._stub(tail[i0], k0)
                del window[:overdue]
                self.overdue_free = 0

    def _clip(self, event: Event, i: int, k: int) -> int:
        keep = clip_keep(event, self.limit, self.encoding)
        self.clipped[event.position] = keep
        self._later(k, (i, _CUT, keep))
        return clipped_cost(event, keep, self.encoding)

    def _later(self, k: int, how: Rebuild) -> None:
        """Slot ``k`` is made on every call (its text is not kept twice)."""
        self._put(k, _PENDING)
        self.rebuild[k] = how

    def _stub(self, event: Event, k: int) -> None:
        """A tool result leaves the keep window (or never enters it): a stub from now on."""
        pos = event.position
        if k < len(self.messages):
            keep = self.clipped.pop(pos, None)
            old = event.tokens if keep is None else clipped_cost(event, keep, self.encoding)
            self.rebuild.pop(k, None)
            self.owned_bytes -= self._owned(event, self.messages[k])
        else:
            old = 0
        short = stub(event)
        self._put(k, short)
        self.owned_bytes += _owned_size(short)
        self.results_tokens += stub_cost(short, self.encoding) - old
        if self.stubbed is None:
            self.stubbed = []
        self.stubbed.append(pos)

    def _put(self, k: int, message: ContextMessage) -> None:
        if k == len(self.messages):
            self.messages.append(message)
        else:
            if self.lent:  # a rendered context may still read this list: change a copy
                self.messages = list(self.messages)
                self.lent = False
            self.messages[k] = message
            if k < self.dirty:
                self.dirty = k  # the hash chain from here on is stale

    @staticmethod
    def _owned(event: Event, message: ContextMessage) -> int:
        if message is event.body or message is _PENDING:
            return 0
        return _owned_size(message)

    # --- rendering -------------------------------------------------------------------

    def render(
        self,
        tail: Sequence[Event],
        checkpoint: Checkpoint | None,
        head: Sequence[Block],
        system_prompt: str,
        tools: Sequence[ToolSpec],
        ceiling: int,
        *,
        recalled: Block | None = None,
        task_card: int | None = None,
        pushed: tuple[tuple[int, int], ...] = (),
    ) -> Rendered | None:
        """The context the full path would render, or None when it has to enforce the ceiling.

        Call :meth:`advance` first. ``head``, ``recalled``, ``task_card`` and
        ``pushed`` as :func:`~torpor.compaction.render.materialize` takes them.
        """
        encoding = self.encoding
        pending = self.unanswered
        k_user, i_user = self.last_user
        memo = self.lead_memo
        if memo is None or memo.prompt is not system_prompt or memo.head is not head:
            memo = self.lead_memo = _Lead(
                system_prompt,
                head,
                [SystemMessage(system_prompt), *(SystemMessage(b.text) for b in head)],
                text_tokens(system_prompt, encoding),
            )
        sections = {"system": memo.tokens, "markers": 0}
        for block in head:
            sections[block.name] = block.tokens
        sections["tools"] = self._tools(tools)
        sections["tail"] = self.tail_tokens
        sections["tool_results"] = self.results_tokens + len(pending) * self.standin_tokens
        sections["user"] = tail[i_user].tokens if k_user >= 0 else 0
        if recalled is not None:
            sections[recalled.name] = recalled.tokens
        total = sum(sections.values())
        if total > ceiling:
            return None
        lead = memo.messages  # never changed once made: views of earlier calls share it
        after: list[ContextMessage] = []
        synthesized = tuple(self.synthesized or ())
        if pending:
            after.extend(synthetic(call) for call in pending.values())
            synthesized += tuple(call.id for call in pending.values())
        if recalled is not None:  # after the tail: chosen per call, so hashed per call
            after.append(SystemMessage(recalled.text))
        body = self.messages
        messages: Sequence[ContextMessage]
        if self.rebuild:  # slots made per call (clips, previews): a copy with them filled in
            copy = [*lead, *body]
            self._remake(tail, copy, len(lead))
            body = copy[len(lead):]
            messages = copy + after
        else:  # the cache's own list, shared until it changes a slot (see _put)
            messages = MessageView(lead, body, len(body), after)
            self.lent = True
        recipe = Recipe(
            checkpoint_position=checkpoint.position if checkpoint is not None else None,
            cycle=checkpoint.cycle if checkpoint is not None else 0,
            tail_start=tail[0].position if tail else None,
            tail_end=self.max_position if tail else None,
            stubbed=tuple(self.stubbed or ()),
            clipped=tuple(sorted(self.clipped.items())),
            dropped=tuple(self.orphans or ()),
            synthesized=synthesized,
            ceiling_enforced=False,
            system_hash=text_hash(system_prompt),
            tools=self.tool_names,
            encoding=encoding,
            turn=tail[-1].turn if tail else None,
            task_card=task_card,
            pushed=pushed,
        )
        return Rendered(
            messages=messages,
            recipe=recipe,
            hash=self._hash(memo, body, after),
            sections=sections,
            estimated_tokens=total,
        )

    def _hash(self, lead: _Lead, body: list[ContextMessage], after: list[ContextMessage]) -> str:
        """:func:`~torpor.compaction.recipe.payload_hash` of ``lead``'s messages, ``body``
        (the slots, as rendered) and ``after``, carried over from the last call: only slots
        new or changed since are hashed."""
        n = len(self.messages)
        key = (lead.prompt, lead.head)  # equal blocks: the same messages, the same prefix
        if self.prefix != key:  # a new prompt (or the first call): every slot again
            state = CHAIN_SEED
            for message in lead.messages:
                state = chain(state, message)
            self.prefix = key
            self.prefix_state = self.state = state
            self.hashed = 0
            self.marks.clear()
        elif self.dirty < self.hashed:  # a slot changed: from the kept state below it
            j = self.dirty // STRIDE
            self.hashed = j * STRIDE
            self.state = bytes(self.marks[(j - 1) * 32 : j * 32]) if j else self.prefix_state
            del self.marks[j * 32 :]
        self.dirty = _CLEAN
        state = self.state
        for k in range(self.hashed, n):
            state = chain(state, body[k])
            if (k + 1) % STRIDE == 0:
                self.marks += state
        self.hashed = n
        self.state = state
        for message in after:  # stand-ins for open calls, recalled: per call
            state = chain(state, message)
        return chain_end(state, self.tools_digest)

    def _tools(self, tools: Sequence[ToolSpec]) -> int:
        """The tool specs' token cost; with their digest, worked out when they change (an
        agent passes the same specs on every call)."""
        if tools is not self.tools:
            specs = tuple(tools)  # a copy of a list (the caller may change it), a tuple itself
            if specs != self.tools:
                self.tools_digest = tools_digest(specs)
                self.tools_tokens = tools_tokens(specs, self.encoding)
                self.tool_names = tuple(t.name for t in specs)
            self.tools = specs
        return self.tools_tokens

    def _remake(self, tail: Sequence[Event], messages: list[ContextMessage], start: int) -> None:
        """Make the slots kept as recipes: clipped texts, artifact previews, aborted answers."""
        located: list[tuple[int, Rebuild]] = []
        for k, (i, head, extra) in self.rebuild.items():
            event = tail[i]
            if head == _WHOLE:
                message = whole(event)
            else:
                if head == _CUT:
                    head, extra = self._locate(event, extra)
                    located.append((k, (i, head, extra)))
                if head == _RECLIP:
                    message = clipped(event, extra, self.encoding)
                else:
                    message = clipped_with(event, clip_source(event)[:head] + _REPLACEMENT * extra)
            messages[start + k] = message
        for k, how in located:
            self.rebuild[k] = how

    def _locate(self, event: Event, keep: int) -> tuple[int, int]:
        """Where clipping to ``keep`` tokens cuts the text, found once by clipping it.

        Tokens are byte sequences, so the first ``keep`` decode to a prefix of the
        text, ending with replacement characters when the cut splits a character.
        Returns (characters kept, replacement characters), or (_RECLIP, keep) when
        the clip is not of that shape (then it is clipped again on every call).
        """
        source = clip_source(event)
        cut = clip_text(source, keep, self.encoding)
        for extra in range(4):
            head = len(cut) - extra
            if head < 0 or (extra and cut[head:] != _REPLACEMENT * extra):
                break
            if source.startswith(cut[:head]) if extra else source.startswith(cut):
                return head, extra
        return _RECLIP, keep

    # --- accounting ------------------------------------------------------------------

    def footprint(self) -> int:
        """What the cache keeps alive beyond the working set's events (O(1))."""
        return self._containers() + self.owned_bytes

    def walk_footprint(self, tail: Sequence[Event]) -> int:
        """:meth:`footprint` counted from scratch (for tests)."""
        bodies = {id(e.body) for e in tail}
        owned = sum(
            _owned_size(m) for m in self.messages if id(m) not in bodies and m is not _PENDING
        )
        return self._containers() + owned

    def _containers(self) -> int:
        return (
            sys.getsizeof(self)
            + sys.getsizeof(self.messages)
            + sys.getsizeof(self.rebuild)
            + len(self.rebuild) * _REBUILD_SIZE
            + sys.getsizeof(self.unanswered)
            + sys.getsizeof(self.window)
            + sys.getsizeof(self.stubbed)
            + sys.getsizeof(self.clipped)
            + sys.getsizeof(self.orphans)
            + sys.getsizeof(self.synthesized)
            + sys.getsizeof(self.marks)
            + sys.getsizeof(self.state)
            + sys.getsizeof(self.prefix_state)
            + sys.getsizeof(self.tools_digest)
        )


_REBUILD_SIZE = sys.getsizeof((0, 0, 0))


class _Lead(NamedTuple):
    """The system messages rendered for one prompt and head, with their tokens and texts."""

    prompt: str
    head: Sequence[Block]
    messages: list[ContextMessage]
    tokens: int


def _owned_size(message: ContextMessage) -> int:
    """A message made by the cache, with its text unless that is a shared constant."""
    text = message.content if isinstance(message, ToolResult) else message.text
    size = sys.getsizeof(message)
    if text is not INTERRUPTED_RESULT:
        size += str_bytes(text)
    return size
