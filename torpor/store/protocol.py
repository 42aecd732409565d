"""The EventStore protocol and the records it returns.

The log is append-only: rows are written once and never updated or deleted by
anything the runtime does. The one exception is :meth:`EventStore.delete`, asked
for by the data's owner and recorded in the ``deletions`` audit. Every backend
implements this protocol; the runtime, the actors and compaction only ever see it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from torpor.events import Body, Event
from torpor.store.listing import ConversationPage, Deletion
from torpor.store.memory import EpisodicItem, LedgerEntry, MemoryRecord, SemanticItem
from torpor.store.schedules import Firing, NewSchedule, Schedule

__all__ = [
    "Checkpoint",
    "ConversationInfo",
    "ConversationPage",
    "Deletion",
    "EventStore",
    "HintExtractor",
    "Marker",
    "ModelCall",
    "PendingApproval",
    "PendingCall",
    "OpenCall",
    "Resume",
    "SearchHit",
    "TokenCounter",
]

TokenCounter = Callable[[Body], int]
"""Counts the tokens of one event body (role framing included). Called once, at append."""

HintExtractor = Callable[[Body], bytes]
"""What compaction wants remembered about one event body (its topic hints), as bytes the
store keeps opaque in the event's row and hands back on :attr:`Event.hints`. Called once,
at append, like the token counter, so a fold never has to re-read every folded event."""


class Marker(msgspec.Struct, frozen=True, gc=False):
    """A pointer to a folded span of the log: where it was, when, and what it was about."""

    start: int  # first folded position
    end: int  # last folded position (inclusive)
    start_ms: int
    end_ms: int
    topics: tuple[str, ...] = ()
    level: int = 0  # how many merges built it (hierarchical merging)


class Background(msgspec.Struct, frozen=True, gc=False):
    """What a conversation's folded events are commonly about: in how many of them (of
    the ``events`` whose prose words a fold read) each of the most frequent prose words
    appears, most frequent first. Bounded (torpor.compaction.background), carried by each
    checkpoint, so a revival scores a span's words against it without reading the log."""

    events: int = 0
    words: tuple[str, ...] = ()
    counts: tuple[int, ...] = ()


class Checkpoint(msgspec.Struct, frozen=True, gc=False):
    """A fold: covers every position before ``position``. Deletes nothing."""

    conversation_id: str
    position: int
    created_at: int
    cycle: int  # compaction cycle number, 1 for the first fold
    markers: tuple[Marker, ...] = ()
    summary: str = ""  # optional narrative handoff (Summarizer strategy)
    tokens: int = 0  # tokens the handoff costs when rendered
    # The task card in effect when the fold was made (its TaskCard event), so a revival
    # that reads only the events after the fold still renders it. None: no card, or a
    # checkpoint written before cards existed.
    task_card: Event | None = None
    # The memory bundle rendered at this fold (torpor.memory.bundle): the most salient
    # episodic and semantic items, shown before the markers instead of ``summary``.
    memory: str = ""
    # Document frequencies of prose words over every event this checkpoint covers (None:
    # none yet, or a checkpoint written before they were kept): the background markers'
    # prose topics must stand out from.
    background: Background | None = None


class Resume(msgspec.Struct, frozen=True, gc=False):
    """What revival needs, read in one hop: the latest checkpoint and every event after it."""

    conversation_id: str
    head: int | None  # last position, None for an empty conversation
    checkpoint: Checkpoint | None
    events: tuple[Event, ...]


class SearchHit(msgspec.Struct, frozen=True, gc=False):
    position: int
    kind: str
    turn: int
    created_at: int
    snippet: str
    # 0 to 1, the same scale on every backend: the share of the query the hit holds,
    # never above a better-ranked hit's (torpor.store.fulltext.calibrated).
    score: float
    rank: float = 0.0  # the backend's own relevance (bm25 negated; ts_rank): higher is better


class ConversationInfo(msgspec.Struct, frozen=True, gc=False):
    """One row of the conversations index (never a read of the log).

    ``updated_at`` is the last activity (an append or a fold; also ``last_activity``);
    ``title`` defaults to the first user message, clipped, unless the host set one;
    ``metadata`` is the host's (JSON values). ``id`` and ``events`` are the names the
    runtime's listing uses for ``conversation_id`` and ``event_count``.
    """

    conversation_id: str
    head: int | None
    event_count: int
    checkpoint_position: int | None
    bytes: int  # stored body bytes
    created_at: int
    updated_at: int
    title: str = ""
    metadata: dict[str, Any] = {}

    @property
    def id(self) -> str:
        return self.conversation_id

    @property
    def last_activity(self) -> int:
        return self.updated_at

    @property
    def events(self) -> int:
        return self.event_count


class ModelCall(msgspec.Struct, frozen=True, gc=False):
    """One row of the model-call audit: what was rendered (as a recipe) and what it cost.

    ``cache_read_tokens`` / ``cache_write_tokens``: of the reported prompt, what the
    provider read from / wrote to its prompt cache (None: not reported).
    ``turn_id`` … ``topic_changed``: the call's anatomy (None: a row written before
    torpor recorded it).
    ``purpose``: ``"turn"`` for a call that answers the conversation (its recipe
    rebuilds what it was sent), ``"summary"`` for a summarizer's call at a fold
    (its recipe names the folded span; its prompt is the summarizer's own).
    """

    conversation_id: str
    turn: int
    call_index: int
    compaction_cycle: int
    recipe: bytes  # msgpack recipe that rebuilds the rendered context from the log
    rendered_hash: str
    sections: dict[str, int]  # tokens per section: system, markers, tail, tool_results, user
    estimated_prompt_tokens: int
    utilization: float  # estimated prompt tokens / input budget
    reported_prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_ms: float | None = None
    ttft_ms: float | None = None
    created_at: int = 0
    model: str = ""
    error: str | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None
    purpose: str = "turn"
    # The anatomy of design source 001, Annex A.4 (torpor.compaction.anatomy). Added
    # last, with defaults, so rows written before them still decode (as unknown).
    turn_id: str = ""  # time-sortable (ULID-shaped), the same on every call of the turn
    events_in_context: int | None = None  # conversation messages rendered
    markers: int | None = None  # time-range markers in context
    topic: str | None = None  # the turn's detected topic (its best topic hint)
    topic_changed: bool | None = None  # the topic differs from the previous call's
    # Task-conditioned push (torpor.compaction.push): the positions in the recalled
    # section and their scores (0-1), in the order rendered. Empty: nothing was pushed
    # (push off, no folded history, no candidate), or a row written before push.
    pushed: tuple[int, ...] = ()
    pushed_scores: tuple[float, ...] = ()


class PendingCall(msgspec.Struct, frozen=True, gc=False):
    """One tool call waiting for an outside answer (see :meth:`EventStore.pending`)."""

    call_id: str
    tool: str  # "" for a suspension logged before tool names were recorded
    since: int  # epoch ms of the Suspended event
    position: int  # of the Suspended event


class OpenCall(msgspec.Struct, frozen=True):
    """One call of a conversation waiting for an outside answer, with what it asked for
    (see :meth:`EventStore.open_calls`)."""

    call_id: str
    tool: str  # "" for a suspension logged before tool names were recorded
    arguments: dict[str, Any]  # the model's arguments ({} if the log holds no such call)
    since: int  # epoch ms of the Suspended event
    position: int  # of the Suspended event


class PendingApproval(msgspec.Struct, frozen=True, gc=False):
    """A conversation waiting for outside answers, evicted or not."""

    conversation_id: str
    calls: tuple[PendingCall, ...]  # in log order
    since: int  # epoch ms: the oldest call's


class PendingSummary(msgspec.Struct, frozen=True, gc=False):
    """How many tool calls wait for an outside answer, in how many conversations, since
    when (``oldest``: epoch ms of the oldest waiting call; None when none waits)."""

    conversations: int
    calls: int
    oldest: int | None


@runtime_checkable
class EventStore(Protocol):
    """The append-only log. All methods are awaitable; every one is one trip to the backend."""

    @property
    def read_only(self) -> bool:
        """Every write is refused (FencedError): a PostgreSQL database a cluster of nodes
        serves, opened without a node's fence. Nothing is owed to such a store's log here."""
        ...

    def append(
        self,
        conversation_id: str,
        events: Sequence[Body],
        *,
        turn: int = 0,
        expect_head: int | None = None,
        key: str | None = None,
    ) -> Awaitable[list[int]]:
        """Append events atomically; return their positions (0, 1, 2, … per conversation).

        ``expect_head``: the caller's idea of the current head (-1 for an empty
        conversation); a mismatch raises ConflictError and writes nothing.
        ``key``: idempotency key; a key seen before with the same bodies returns the
        first positions and writes nothing; with different bodies it raises
        IdempotencyConflict and writes nothing.

        Errors, all raised before anything is written: InvalidInput (an id or
        text the log cannot hold, a bad argument), EventTooLarge, ConflictError,
        IdempotencyConflict, StoreUnavailable (the database cannot write now;
        the same call may succeed later).

        Awaitable, not necessarily a coroutine: a backend may check and queue the
        append when called and hand back the commit's future (SQLite does); an
        error is still raised where the result is awaited.
        """
        ...

    def append_events(
        self,
        conversation_id: str,
        events: Sequence[Body],
        *,
        turn: int = 0,
        expect_head: int | None = None,
        key: str | None = None,
        fired: Firing | None = None,
    ) -> Awaitable[list[Event]]:
        """Like ``append``, but returns the events as stored: positions, token counts,
        created_at, and bodies after clipping (what a working set must hold).

        ``fired``: the schedule these events fire (:mod:`torpor.store.schedules`): in the
        same transaction it must still be due at ``fired.due`` (else ScheduleGone, nothing
        written) and moves to ``fired.next_due`` (None: done)."""
        ...

    async def head(self, conversation_id: str) -> int | None: ...

    async def read_since(self, conversation_id: str, position: int) -> list[Event]:
        """Events with position >= ``position``, oldest first.

        Reads check that the log is dense: a missing position raises
        ``CorruptEvent(conversation_id, position, "missing")``.
        """
        ...

    async def read_range(self, conversation_id: str, start: int, end: int) -> list[Event]:
        """Events with start <= position <= end, oldest first."""
        ...

    async def keyed(self, conversation_id: str, key: str) -> list[Event] | None:
        """The events the append under idempotency ``key`` wrote to this conversation,
        oldest first; None if no append used that key here. Writes nothing (what a
        caller asks before repeating a request it may not repeat blindly: resolve)."""
        ...

    async def page_backward(
        self, conversation_id: str, before: int | None = None, limit: int = 50
    ) -> list[Event]:
        """Newest first, positions < ``before`` (keyset pagination)."""
        ...

    async def resume(self, conversation_id: str) -> Resume:
        """Latest checkpoint plus the events since it, in one trip."""
        ...

    async def put_checkpoint(self, checkpoint: Checkpoint) -> None: ...

    async def latest_checkpoint(self, conversation_id: str) -> Checkpoint | None: ...

    async def checkpoints(self, conversation_id: str) -> list[Checkpoint]: ...

    async def search(
        self, conversation_id: str, query: str, k: int = 10, *, exclude_tools: Iterable[str] = ()
    ) -> list[SearchHit]:
        """Ranked hits, best first; results of the tools in ``exclude_tools`` left out."""
        ...

    async def put_artifact(self, conversation_id: str, data: bytes) -> str: ...

    async def get_artifact(self, artifact_id: str) -> bytes: ...

    def record_model_call(self, call: ModelCall) -> Awaitable[None]:
        """Store one audit row (awaitable; SQLite queues it for its group commit at once)."""
        ...

    async def model_calls(
        self, conversation_id: str, *, turn: int | None = None, limit: int = 100
    ) -> list[ModelCall]: ...

    async def conversations(
        self, *, after: str | None = None, limit: int = 100
    ) -> list[ConversationInfo]: ...

    async def conversation(self, conversation_id: str) -> ConversationInfo | None: ...

    async def list_conversations(
        self, *, prefix: str | None = None, after: str | None = None, limit: int = 50
    ) -> ConversationPage:
        """The conversations index, newest activity first (ties: newest created first),
        those whose id starts with ``prefix``; ``after``: the ``next`` cursor of the page
        before. From an index on (last activity, key), never a log scan."""
        ...

    async def describe(
        self,
        conversation_id: str,
        *,
        title: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Set the title and/or replace the metadata (None: leave it); False when the
        conversation does not exist (nothing is created)."""
        ...

    async def delete(self, conversation_id: str, *, by: str = "delete") -> Deletion | None:
        """Remove everything the store keeps about the conversation and its sub-agent
        conversations (recursively) in one transaction, and record the removal in
        ``deletions`` (ids and counts, never content); None when there is no such
        conversation. The one exception to "rows are never deleted": asked for by its
        owner (``by``: "delete", "redact" or "retention"), never by the runtime itself.
        On a clustered node the delete is fenced like any write."""
        ...

    async def subtree(self, conversation_id: str) -> list[str]:
        """The conversations :meth:`delete` would remove now: this one and its sub-agent
        conversations (recursively), parents first; [] for an unknown one."""
        ...

    async def idle_conversations(
        self,
        *,
        before: int,
        limit: int = 100,
        shards: Sequence[int] | None = None,
        shard_count: int | None = None,
    ) -> list[str]:
        """Conversations whose last activity is before ``before`` (epoch ms), least recent
        first, of ``shards`` if given (retention); from the activity index."""

    async def redact(self, conversation_id: str, position: int, *, reason: str = "") -> bool:
        """Replace one event's body with a ``Redacted`` one in place and remove every
        derived copy of its text (torpor.store.redact), in one transaction recorded in
        ``deletions`` (by "redact", the position in ``rows``). True when redacted, False
        when it was redacted already with this ``reason``; UnknownConversation;
        InvalidInput (no such position, no content, redacted with another reason). The
        other exception to "rows are never updated"; fenced on a clustered node."""
        ...

    async def deletions(self, *, after: int | None = None, limit: int = 100) -> list[Deletion]:
        """The deletions audit, oldest first, those with an id above ``after``."""
        ...

    async def pending(
        self, *, after: str | None = None, limit: int = 100
    ) -> list[PendingApproval]:
        """Conversations with tool calls waiting for an outside answer, ordered by id,
        those after ``after`` (keyset pagination), from an index: never a log scan."""
        ...

    async def open_calls(self, conversation_id: str) -> list[OpenCall]:
        """The conversation's calls waiting for an outside answer, in log order, from the
        pending-approvals index (its primary key), with their arguments from the one
        assistant message that made them: never a scan of the log."""
        ...

    async def pending_summary(self) -> PendingSummary:
        """Counts of the pending-approvals index and its oldest call (for metrics): one
        aggregate over the index, whose size is the calls waiting, never the log's."""
        ...

    async def open_work(
        self,
        *,
        shards: Sequence[int] | None = None,
        shard_count: int | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> list[str]:
        """Conversations that owe a run if no process runs them: a turn left open (neither
        answered, aborted nor suspended) or user messages logged behind it, unless they wait
        for an outside answer or are parked (:mod:`torpor.store.open_work`, which may name
        one that owes nothing, never misses one). Ordered by id, those after ``after``
        (keyset pagination); ``shards`` (with ``shard_count``, the cluster's count): only
        the conversations of those shards. From an index maintained with the appends:
        never a log scan."""
        ...

    # Schedules (torpor.store.schedules): rows beside the log, fired by appends.

    async def add_schedule(self, new: NewSchedule, *, at_most: int | None = None) -> Schedule:
        """Store a checked schedule (or return the one its key stored); UnknownConversation,
        IdempotencyConflict, TooManySchedules (``at_most`` pending already)."""
        ...

    async def remove_schedule(self, conversation_id: str, schedule_id: str) -> bool:
        """Cancel a pending schedule; False when the conversation has no such one pending."""
        ...

    async def conversation_schedules(self, conversation_id: str) -> list[Schedule]:
        """The conversation's pending schedules, soonest first."""
        ...

    async def list_schedules(
        self, *, after: str | None = None, limit: int = 100
    ) -> list[Schedule]:
        """Every pending schedule by id, after ``after`` (keyset pagination)."""
        ...

    async def due_schedules(
        self,
        *,
        until: int,
        limit: int = 100,
        shards: Sequence[int] | None = None,
        shard_count: int | None = None,
    ) -> list[Schedule]:
        """Pending schedules due at ``until`` (epoch ms) or before, soonest first, of
        ``shards`` if given; from the due index."""
        ...

    async def next_due(
        self,
        *,
        after: int,
        shards: Sequence[int] | None = None,
        shard_count: int | None = None,
    ) -> int | None:
        """The soonest due time after ``after`` of a pending schedule (of ``shards``)."""
        ...

    # Derived memory (torpor.store.memory): written beside the log, never into it.

    async def put_memory(
        self,
        conversation_id: str,
        *,
        episodes: Sequence[EpisodicItem] = (),
        facts: Sequence[SemanticItem] = (),
        replace_after: int | None = None,
    ) -> None:
        """Store a fold's episodic and semantic items; an item whose id is stored already
        is kept as it was (a retried fold writes nothing twice). ``replace_after``: first
        drop, in the same transaction, the items at positions after it that no stored
        checkpoint's position backs (what a fold whose checkpoint was never written left
        behind; a fold passes its previous checkpoint's position). The conversation must
        exist (UnknownConversation otherwise: a fold racing a delete creates nothing)."""
        ...

    async def put_ledger(
        self,
        conversation_id: str,
        entries: Sequence[LedgerEntry],
        *,
        tail: int = 256,
        stored_only: bool = False,
    ) -> None:
        """Record consolidation decisions; keeps the latest per key plus ``tail`` more.
        ``stored_only``: every item the entries name must be stored, checked in the same
        transaction (MemoryChanged, nothing written, otherwise: a sweep that read the
        memory before a redaction dropped some of it). UnknownConversation for a
        conversation that does not exist."""
        ...

    async def put_turn_decision(self, conversation_id: str, turn: int, decision: str) -> None:
        """A hot-path reconciler's verdict ("add" or "none") on one whole turn."""
        ...

    async def memory(self, conversation_id: str) -> MemoryRecord:
        """Items, ledger and skipped turns of one conversation (empty when it has none)."""
        ...
