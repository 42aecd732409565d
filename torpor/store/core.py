"""What both store backends share above the database: the public, validating methods.

Every argument a caller passes is checked here, once, the same way for SQLite
and PostgreSQL (so a bad id, cursor or limit is the same InvalidInput on
both), and appends are prepared by one :class:`~torpor.store.prepare.AppendPolicy`
(token counting, clip-on-entry). A backend supplies only what differs: how an
operation is queued for its group commit (``_submit`` and the ``_*_op``
builders) and how a read helper is run on its connections (``_reading``, with
the helpers of its ``reads`` module, which share one set of names and
signatures after the connection).

**Large appends are prepared off the event loop.** Measuring an event (its
token count above all) costs time in proportion to its text: a megabyte takes
a few hundred milliseconds, which on the loop would stall every other
conversation. An append with more than :data:`~torpor.store.prepare.INLINE_TEXT`
characters of text is prepared on a worker thread instead (the token counter
hands long texts to tiktoken's core in segments, and the core releases the GIL
while it encodes), then queued for the group commit. Appends of the same
conversation made meanwhile wait for it, each queued after the one before, so
positions follow the order of the calls; other conversations' appends are
queued at once as usual.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import ModuleType, TracebackType
from typing import Any, NoReturn, Self, cast

import msgspec

from torpor.errors import ConfigError, InvalidInput, MemoryChanged
from torpor.events import Body, Event
from torpor.store.admit import admit_model_call, check_checkpoint
from torpor.store.arguments import (
    POSITION_LIMIT,
    check_after,
    check_conversation_id,
    check_int,
    check_limit,
    check_position,
    check_turn,
    search_query,
    tool_names,
)
from torpor.store.listing import (
    ConversationPage,
    Deletion,
    check_cause,
    check_metadata,
    check_title,
    decode_cursor,
    prefix_range,
)
from torpor.store.memory import (
    EpisodicItem,
    LedgerEntry,
    MemoryRecord,
    SemanticItem,
    check_episode,
    check_fact,
    check_items,
    check_ledger_entry,
)
from torpor.store.memory_rows import LEDGER_TAIL, MemoryWrite, encode_row, named_items
from torpor.store.open_work import ShardFilter, shard_filter
from torpor.store.prepare import (
    INLINE_TEXT,
    AppendPolicy,
    OffLoop,
    PreparedAppend,
    estimate_tokens,
    new_artifact_id,
    now_ms,
)
from torpor.store.protocol import (
    Checkpoint,
    ConversationInfo,
    HintExtractor,
    ModelCall,
    OpenCall,
    PendingApproval,
    PendingSummary,
    Resume,
    SearchHit,
    TokenCounter,
)
from torpor.store.redact import check_reason
from torpor.store.schedules import (
    Firing,
    NewSchedule,
    Schedule,
    check_schedule_id,
    check_until,
)
from torpor.store.sqlite.schema import Durability
from torpor.text import check_id

__all__ = ["StoreCore"]


class StoreCore:
    """The validating half of an :class:`~torpor.store.protocol.EventStore`."""

    reads: ModuleType  # the backend's read helpers: ``fn(connection, *args)``

    @property
    def read_only(self) -> bool:
        return False

    def __init__(
        self,
        *,
        token_counter: TokenCounter | None,
        hint_extractor: HintExtractor | None,
        durability: Durability,
        artifact_threshold: int,
        max_event_bytes: int,
        readers: int,
        max_batch: int,
    ) -> None:
        if durability not in ("normal", "full"):
            raise ConfigError("durability", f"must be 'normal' or 'full', got {durability!r}")
        if type(readers) is not int or readers < 1:
            raise ConfigError("readers", "at least one reader connection is needed")
        if type(max_batch) is not int or max_batch < 1:
            raise ConfigError("max_batch", "must be at least 1")
        self.durability: Durability = durability
        self._policy = AppendPolicy(
            token_counter=token_counter,
            hint_extractor=hint_extractor,
            artifact_threshold=artifact_threshold,
            max_event_bytes=max_event_bytes,
            inline_text=INLINE_TEXT,
        )
        # Conversations with an append being prepared off the loop, each with a future that
        # is done once the last of them is queued (see the module docstring).
        self._deferred: dict[str, asyncio.Future[None]] = {}
        self._reader_count = readers
        self._max_batch = max_batch

    # what a backend supplies -----------------------------------------------------------

    async def open(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def _submit(self, op: Any) -> Awaitable[Any]:
        """Queue ``op`` for the group commit; its result once committed.

        An awaitable, not necessarily a coroutine: a backend may hand back the
        commit's future itself (a write waiting for its batch then holds one
        object less, which the cyclic GC would otherwise walk).
        """
        raise NotImplementedError

    async def _reading(self, fn: Any, *args: Any) -> Any:
        """Run the read helper ``fn(connection, *args)`` on a reader connection."""
        raise NotImplementedError

    def _append_op(
        self, prepared: PreparedAppend, with_events: bool, audit: ModelCall | None = None
    ) -> Any:
        raise NotImplementedError

    def _checkpoint_op(self, checkpoint: Checkpoint) -> Any:
        raise NotImplementedError

    def _artifact_op(self, conversation_id: str, artifact_id: str, data: bytes) -> Any:
        raise NotImplementedError

    def _model_call_op(self, call: ModelCall) -> Any:
        raise NotImplementedError

    async def _search(
        self, conversation_id: str, query: str, k: int, exclude: frozenset[str]
    ) -> list[SearchHit]:
        """Search with arguments already checked (``query`` through :func:`search_query`)."""
        raise NotImplementedError

    async def _write_memory(self, write: MemoryWrite) -> None:
        raise NotImplementedError

    async def _read_memory(self, conversation_id: str) -> MemoryRecord:
        raise NotImplementedError

    async def _describe(self, name: str, title: str | None, metadata: str | None) -> bool:
        raise NotImplementedError

    async def _delete(self, name: str, by: str) -> Deletion | None:
        raise NotImplementedError

    async def _redact(self, name: str, position: int, reason: str) -> Deletion | None:
        raise NotImplementedError

    async def _add_schedule(self, new: NewSchedule, at_most: int | None) -> Schedule:
        raise NotImplementedError

    async def _remove_schedule(self, name: str, schedule_id: str) -> bool:
        raise NotImplementedError

    def _count_redacted(self, body: Body) -> int:
        """Tokens of a redacted event: its stand-in's, by the append's counter."""
        counter = self._policy.token_counter
        return estimate_tokens(body) if counter is None else counter(body)

    # lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # writes ----------------------------------------------------------------------------

    def append(
        self,
        conversation_id: str,
        events: Sequence[Body],
        *,
        turn: int = 0,
        expect_head: int | None = None,
        key: str | None = None,
    ) -> Awaitable[list[int]]:
        return self._queue_append(conversation_id, events, turn, expect_head, key, False)

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
        """Like :meth:`append`, returning the events as stored (clipped bodies, token counts).

        ``fired``: the schedule these events fire, moved in the same transaction (or
        ScheduleGone, nothing written, when it is no longer due at ``fired.due``)."""
        if fired is not None:
            return self._queue_firing(conversation_id, events, turn, expect_head, fired)
        return self._queue_append(conversation_id, events, turn, expect_head, key, True)

    def _queue_firing(
        self, name: str, events: Sequence[Body], turn: int, head: int | None, fired: Firing
    ) -> Awaitable[Any]:
        """An append that fires a schedule: its text is bounded (MAX_SCHEDULE_TEXT), so it
        is always prepared here, on the loop."""
        try:
            if not isinstance(fired, Firing):
                raise InvalidInput("fired", "must be a Firing")
            prepared = self._policy.prepare(name, events, turn=turn, expect_head=head, key=None)
            prepared = msgspec.structs.replace(prepared, fired=fired)
            if self._deferred:
                return self._behind(prepared, True, None)
            return self._submit(self._append_op(prepared, True))
        except Exception as exc:  # OffLoop included: a firing is never that long
            return _raising(exc)

    def _queue_append(
        self, name: str, events: Sequence[Body], turn: int, head: int | None, key: str | None,
        with_events: bool,
    ) -> Awaitable[Any]:
        """Checked and queued when called, like :meth:`record_model_call`: on SQLite the
        caller then awaits the commit's future itself, with no coroutine of ours around
        it (one frame and one object less per append waiting for its batch)."""
        try:
            prepared = self._policy.prepare(name, events, turn=turn, expect_head=head, key=key)
            if self._deferred:  # some conversation's append is being prepared off the loop
                return self._behind(prepared, with_events, None)
            return self._submit(self._append_op(prepared, with_events))
        except OffLoop:
            pass
        except Exception as exc:  # raised where it is awaited, as from a coroutine
            return _raising(exc)
        return self._off_loop(name, events, turn, head, key, with_events, None)

    def _append_audited(
        self, name: str, events: Sequence[Body], turn: int, head: int | None, call: ModelCall
    ) -> Awaitable[list[Event]]:
        """:meth:`append_events` and :meth:`record_model_call` of the model call that
        produced ``events``, as one operation (one future, one plan, one transaction): the
        runtime's answer and its audit row. An answer refused for a stale ``head``
        (ConflictError) still leaves the call's row: the call was made. The runtime's own
        path; what it checks is what the two methods check."""
        try:
            call = _audit_row(call)
            if call.conversation_id != name:
                raise InvalidInput("call.conversation_id", f"must be {name!r}")
            prepared = self._policy.prepare(name, events, turn=turn, expect_head=head, key=None)
            if self._deferred:
                return self._behind(prepared, True, call)
            return self._submit(self._append_op(prepared, True, call))
        except OffLoop:
            pass
        except Exception as exc:  # raised where it is awaited, as from a coroutine
            return _raising(exc)
        return self._off_loop(name, events, turn, head, None, True, call)

    # appends prepared off the loop ---------------------------------------------------

    def _off_loop(
        self, name: str, events: Sequence[Body], turn: int, head: int | None, key: str | None,
        with_events: bool, audit: ModelCall | None,
    ) -> Awaitable[Any]:
        """An append too long to prepare on the loop (:class:`OffLoop`): on a thread."""
        created = now_ms()  # the time of the call, as for an append prepared at once

        def prepare() -> PreparedAppend:
            return self._policy.prepare(
                name, events, turn=turn, expect_head=head, key=key, created=created, inline=False
            )

        return self._defer(name, prepare, True, with_events, audit)

    def _behind(
        self, prepared: PreparedAppend, with_events: bool, audit: ModelCall | None
    ) -> Awaitable[Any]:
        """Queue an append prepared on the loop, after its conversation's deferred ones."""
        name = prepared.conversation_id
        if name not in self._deferred:
            return self._submit(self._append_op(prepared, with_events, audit))
        return self._defer(name, lambda: prepared, False, with_events, audit)

    def _defer(
        self,
        name: str,
        prepare: Callable[[], PreparedAppend],
        threaded: bool,
        with_events: bool,
        audit: ModelCall | None,
    ) -> Awaitable[Any]:
        """An append queued once ``prepare`` has run (on a thread if ``threaded``) and the
        conversation's appends deferred before it are queued. A task, so it goes ahead
        (and lets the appends after it go) whether or not its caller awaits it yet."""
        previous = self._deferred.get(name)
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._deferred[name] = gate
        return asyncio.ensure_future(
            self._deferred_append(name, previous, gate, prepare, threaded, with_events, audit)
        )

    async def _deferred_append(
        self,
        name: str,
        previous: asyncio.Future[None] | None,
        gate: asyncio.Future[None],
        prepare: Callable[[], PreparedAppend],
        threaded: bool,
        with_events: bool,
        audit: ModelCall | None,
    ) -> Any:
        try:
            prepared = await asyncio.to_thread(prepare) if threaded else prepare()
            if previous is not None:
                await asyncio.wait((previous,))  # not cancelled with us: others wait on it too
            # Queued now (SQLite), or at the coroutine's first step, below (PostgreSQL):
            # either way before the next append of this conversation runs again.
            committed = self._submit(self._append_op(prepared, with_events, audit))
        finally:  # refused or cancelled too: the next one still waits for ``previous``
            self._release(name, gate, previous)
        return await committed

    def _release(
        self, name: str, gate: asyncio.Future[None], previous: asyncio.Future[None] | None
    ) -> None:
        """Let the conversation's next deferred append go, once ``previous`` is queued."""
        if previous is not None and not previous.done():
            previous.add_done_callback(lambda _: self._release(name, gate, None))
            return
        if not gate.done():
            gate.set_result(None)
        if self._deferred.get(name) is gate:
            del self._deferred[name]

    async def _settle(self) -> None:
        """Until every append being prepared off the loop is queued (a closing store
        commits what it accepted before it closed; these were accepted)."""
        while self._deferred:
            await asyncio.wait(list(self._deferred.values()))

    async def put_checkpoint(self, checkpoint: Checkpoint) -> None:
        await self._submit(self._checkpoint_op(check_checkpoint(checkpoint)))

    async def put_artifact(self, conversation_id: str, data: bytes) -> str:
        check_conversation_id(conversation_id)
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidInput("data", "artifact data must be bytes")
        op = self._artifact_op(conversation_id, new_artifact_id(), bytes(data))
        return cast(str, await self._submit(op))

    def record_model_call(self, call: ModelCall) -> Awaitable[None]:
        """Store one audit row; a ``created_at`` of 0 is stamped with the current time.

        Checked and queued when called, where the backend queues at once (SQLite):
        a write queued right after it, before anything is awaited, joins the same
        group commit. Await the result for the commit.
        """
        try:
            return cast("Awaitable[None]", self._submit(self._model_call_op(_audit_row(call))))
        except Exception as exc:  # raised where it is awaited, as from a coroutine
            return _raising(exc)

    # derived memory (torpor.store.memory): never the log ------------------------------

    async def put_memory(
        self,
        conversation_id: str,
        *,
        episodes: Sequence[EpisodicItem] = (),
        facts: Sequence[SemanticItem] = (),
        replace_after: int | None = None,
    ) -> None:
        """Store a fold's episodic and semantic items (an item stored before is kept as is,
        unless ``replace_after`` drops it first: see the protocol)."""
        check_conversation_id(conversation_id)
        if replace_after is not None:
            check_int(replace_after, "replace_after", -1, POSITION_LIMIT + 1)
        now = now_ms()
        eps = [_stamped(e, now) for e in check_items(episodes, "episodes", check_episode)]
        fas = [_stamped(f, now) for f in check_items(facts, "facts", check_fact)]
        await self._write_memory(
            MemoryWrite(
                conversation_id,
                episodes=tuple((e.position, e.created_at, encode_row(e)) for e in eps),
                facts=tuple(
                    (f.position, f.ordinal, f.key, f.created_at, encode_row(f)) for f in fas
                ),
                replace_after=replace_after,
            )
        )

    async def put_ledger(
        self,
        conversation_id: str,
        entries: Sequence[LedgerEntry],
        *,
        tail: int = LEDGER_TAIL,
        stored_only: bool = False,
    ) -> None:
        """Record sweep decisions; the ledger keeps the latest decision of every key and,
        beyond those, the newest ``tail`` rows (older ones are pruned: the ledger is
        derived, and must not grow without bound). ``stored_only``: see the protocol."""
        check_conversation_id(conversation_id)
        check_limit(tail, "tail")
        now = now_ms()
        rows = [_stamped(e, now) for e in check_items(entries, "entries", check_ledger_entry)]
        named: tuple[tuple[int, int], ...] = ()
        if stored_only:
            found = named_items(rows)
            if found is None:  # an id no stored item can have
                items = (i for e in rows for i in (e.item, *e.superseded))
                raise MemoryChanged(conversation_id, tuple(dict.fromkeys(items)))
            named = found
        await self._write_memory(
            MemoryWrite(
                conversation_id,
                ledger=tuple((e.key, e.created_at, encode_row(e)) for e in rows),
                prune_tail=tail,
                named=named,
            )
        )

    async def put_turn_decision(self, conversation_id: str, turn: int, decision: str) -> None:
        """A hot-path reconciler's verdict on a whole turn ("add" or "none"); the latest
        one stands. Only the derived memory reads it: the log is complete either way."""
        check_conversation_id(conversation_id)
        check_turn(turn)
        if decision not in ("add", "none"):
            raise InvalidInput("decision", f"must be 'add' or 'none', got {decision!r}")
        write = MemoryWrite(conversation_id, turns=((turn, decision, now_ms()),))
        await self._write_memory(write)

    async def memory(self, conversation_id: str) -> MemoryRecord:
        """The conversation's derived memory: items, ledger and the turns skipped by NONE."""
        check_conversation_id(conversation_id)
        return await self._read_memory(conversation_id)

    # reads -----------------------------------------------------------------------------

    async def head(self, conversation_id: str) -> int | None:
        check_conversation_id(conversation_id)
        return cast("int | None", await self._reading(self.reads.head, conversation_id))

    async def read_since(self, conversation_id: str, position: int) -> list[Event]:
        check_conversation_id(conversation_id)
        check_position(position)
        events = await self._reading(self.reads.read_since, conversation_id, position)
        return cast("list[Event]", events)

    async def read_range(self, conversation_id: str, start: int, end: int) -> list[Event]:
        check_conversation_id(conversation_id)
        check_position(start, "start")
        check_position(end, "end")
        events = await self._reading(self.reads.read_range, conversation_id, start, end)
        return cast("list[Event]", events)

    async def keyed(self, conversation_id: str, key: str) -> list[Event] | None:
        check_conversation_id(conversation_id)
        check_id(key, "key")
        events = await self._reading(self.reads.keyed, conversation_id, key)
        return cast("list[Event] | None", events)

    async def page_backward(
        self, conversation_id: str, before: int | None = None, limit: int = 50
    ) -> list[Event]:
        check_conversation_id(conversation_id)
        if before is not None:
            check_position(before, "before")
        check_limit(limit)
        events = await self._reading(self.reads.page_backward, conversation_id, before, limit)
        return cast("list[Event]", events)

    async def resume(self, conversation_id: str) -> Resume:
        """Latest checkpoint, head and every event since, from one snapshot."""
        check_conversation_id(conversation_id)
        return cast(Resume, await self._reading(self.reads.resume, conversation_id))

    async def latest_checkpoint(self, conversation_id: str) -> Checkpoint | None:
        check_conversation_id(conversation_id)
        found = await self._reading(self.reads.latest_checkpoint, conversation_id)
        return cast("Checkpoint | None", found)

    async def checkpoints(self, conversation_id: str) -> list[Checkpoint]:
        check_conversation_id(conversation_id)
        found = await self._reading(self.reads.checkpoints, conversation_id)
        return cast("list[Checkpoint]", found)

    async def search(
        self, conversation_id: str, query: str, k: int = 10, *, exclude_tools: Iterable[str] = ()
    ) -> list[SearchHit]:
        """Ranked events of one conversation (bm25 on SQLite, ts_rank on PostgreSQL);
        every term of ``query`` is matched literally, query syntax is never interpreted.
        ``exclude_tools``: results of these tools are left out (the index is unchanged;
        the filter applies to this query only)."""
        check_conversation_id(conversation_id)
        check_limit(k, "k")
        exclude = tool_names(exclude_tools)
        return await self._search(conversation_id, search_query(query), k, exclude)

    async def get_artifact(self, artifact_id: str) -> bytes:
        """The full bytes of an artifact; UnknownArtifact (a KeyError) if there is none."""
        check_id(artifact_id, "artifact_id")
        return cast(bytes, await self._reading(self.reads.get_artifact, artifact_id))

    async def model_calls(
        self, conversation_id: str, *, turn: int | None = None, limit: int = 100
    ) -> list[ModelCall]:
        """The most recent ``limit`` calls (of ``turn`` if given), oldest first."""
        check_conversation_id(conversation_id)
        if turn is not None:
            check_turn(turn)
        check_limit(limit)
        calls = await self._reading(self.reads.model_calls, conversation_id, turn, limit)
        return cast("list[ModelCall]", calls)

    async def conversations(
        self, *, after: str | None = None, limit: int = 100
    ) -> list[ConversationInfo]:
        """Conversations ordered by id (bytewise), those after ``after`` (keyset pagination)."""
        check_after(after)
        check_limit(limit)
        found = await self._reading(self.reads.conversations, after, limit)
        return cast("list[ConversationInfo]", found)

    async def conversation(self, conversation_id: str) -> ConversationInfo | None:
        check_conversation_id(conversation_id)
        found = await self._reading(self.reads.conversation, conversation_id)
        return cast("ConversationInfo | None", found)

    async def list_conversations(
        self, *, prefix: str | None = None, after: str | None = None, limit: int = 50
    ) -> ConversationPage:
        """The conversations index newest activity first, those whose id starts with
        ``prefix``; ``after``: a page's ``next`` (store.listing). Never a log scan."""
        span = prefix_range(prefix)
        cursor = decode_cursor(after)
        check_limit(limit)
        page = await self._reading(self.reads.list_conversations, span, cursor, limit)
        return cast(ConversationPage, page)

    async def describe(
        self,
        conversation_id: str,
        *,
        title: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """Set the title and/or replace the metadata; False for an unknown conversation."""
        check_conversation_id(conversation_id)
        text = None if title is None else check_title(title)
        meta = None if metadata is None else check_metadata(metadata)
        if text is None and meta is None:
            return await self.conversation(conversation_id) is not None
        return await self._describe(conversation_id, text, meta)

    async def delete(self, conversation_id: str, *, by: str = "delete") -> Deletion | None:
        """Remove the conversation and its sub-agent conversations from every table, in
        one transaction, recorded in ``deletions``; None for an unknown conversation."""
        check_conversation_id(conversation_id)
        return await self._delete(conversation_id, check_cause(by))

    async def subtree(self, conversation_id: str) -> list[str]:
        """This conversation and its sub-agent conversations, parents first (what a delete
        removes now); [] for an unknown one. Reads the ``spawned`` events only."""
        check_conversation_id(conversation_id)
        return cast("list[str]", await self._reading(self.reads.subtree, conversation_id))

    async def idle_conversations(
        self,
        *,
        before: int,
        limit: int = 100,
        shards: Sequence[int] | None = None,
        shard_count: int | None = None,
    ) -> list[str]:
        """Conversations with no activity since ``before`` (epoch ms), least recent first,
        at most ``limit``; of ``shards`` (of a cluster of ``shard_count``) if given. From
        the index on (last activity, key): never a log scan (retention's sweep)."""
        when = check_int(before, "before", 0, 1 << 62)
        check_limit(limit)
        place = shard_filter(shards, shard_count)
        found = await self._kept_pages(
            self.reads.idle, when, (-1, -1), limit, place,
            lambda name: name, lambda row: (row[2], row[3]),
        )
        return cast("list[str]", found)

    async def redact(self, conversation_id: str, position: int, *, reason: str = "") -> bool:
        """Replace the event at ``position`` with a ``Redacted`` body and remove every
        derived copy of its text (torpor.store.redact), in one transaction recorded in
        ``deletions``. True when redacted; False when it was redacted already with this
        ``reason``. UnknownConversation; InvalidInput for no such position, a kind with
        no content, or an event redacted with another reason."""
        check_conversation_id(conversation_id)
        check_int(position, "position", 0, POSITION_LIMIT)
        return await self._redact(conversation_id, position, check_reason(reason)) is not None

    async def deletions(self, *, after: int | None = None, limit: int = 100) -> list[Deletion]:
        """The deletions audit, oldest first, ids above ``after``."""
        start = -1 if after is None else check_int(after, "after", 0, 1 << 62)
        check_limit(limit)
        found = await self._reading(self.reads.deletions, start, limit)
        return cast("list[Deletion]", found)

    async def pending(
        self, *, after: str | None = None, limit: int = 100
    ) -> list[PendingApproval]:
        """Conversations waiting on outside answers, by id (bytewise), after ``after``."""
        check_after(after)
        check_limit(limit)
        return cast("list[PendingApproval]", await self._reading(self.reads.pending, after, limit))

    async def open_calls(self, conversation_id: str) -> list[OpenCall]:
        """One conversation's calls waiting for an outside answer, with their arguments."""
        check_conversation_id(conversation_id)
        found = await self._reading(self.reads.open_calls, conversation_id)
        return cast("list[OpenCall]", found)

    async def pending_summary(self) -> PendingSummary:
        """How many calls wait for an outside answer, in how many conversations, the oldest."""
        found = await self._reading(self.reads.pending_summary)
        return cast("PendingSummary", found)

    async def open_work(
        self,
        *,
        shards: Sequence[int] | None = None,
        shard_count: int | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> list[str]:
        """Conversations that owe a run (store.open_work), by id (bytewise), after ``after``;
        of ``shards`` (of a cluster of ``shard_count``) if given. From the partial index
        over the open rows: never a log scan."""
        check_after(after)
        check_limit(limit)
        place = shard_filter(shards, shard_count)
        if place is not None and not place.shards:
            return []
        wanted = None if place is None else place.wanted()
        found: list[str] = []
        while True:  # rows the filter leaves out must not end the page early
            rows = await self._reading(self.reads.open_work, after, limit, wanted)
            for name, shard in rows:
                if place is None or place.keeps(name, shard):
                    found.append(name)
                    if len(found) == limit:
                        return found
            if len(rows) < limit:
                return found
            after = rows[-1][0]


    # schedules (torpor.store.schedules) ----------------------------------------------

    async def add_schedule(self, new: NewSchedule, *, at_most: int | None = None) -> Schedule:
        """Store a schedule checked by :func:`torpor.store.schedules.check_new`; the one
        stored before under its key when it has one (IdempotencyConflict if that was
        another request). UnknownConversation for a conversation with no events;
        TooManySchedules when ``at_most`` are pending already. Fenced on a node."""
        if not isinstance(new, NewSchedule):
            raise InvalidInput("new", "must be a NewSchedule (torpor.store.schedules.check_new)")
        if at_most is not None:
            check_int(at_most, "at_most", 1, 1 << 31)
        return await self._add_schedule(new, at_most)

    async def remove_schedule(self, conversation_id: str, schedule_id: str) -> bool:
        """Cancel a pending schedule of the conversation; False when it has no such one
        pending (never had, fired for good, cancelled already). Fenced on a node."""
        check_conversation_id(conversation_id)
        check_schedule_id(schedule_id)
        return await self._remove_schedule(conversation_id, schedule_id)

    async def conversation_schedules(self, conversation_id: str) -> list[Schedule]:
        """The conversation's pending schedules, soonest first."""
        check_conversation_id(conversation_id)
        found = await self._reading(self.reads.conversation_schedules, conversation_id)
        return cast("list[Schedule]", found)

    async def list_schedules(
        self, *, after: str | None = None, limit: int = 100
    ) -> list[Schedule]:
        """Every conversation's pending schedules by id (creation order), after ``after``."""
        start = "" if after is None else check_schedule_id(after)
        check_limit(limit)
        found = await self._reading(self.reads.list_schedules, start, limit)
        return cast("list[Schedule]", found)

    async def due_schedules(
        self,
        *,
        until: int,
        limit: int = 100,
        shards: Sequence[int] | None = None,
        shard_count: int | None = None,
    ) -> list[Schedule]:
        """Pending schedules due at ``until`` (epoch ms) or before, soonest first, of
        ``shards`` (of a cluster of ``shard_count``) if given; from the due index."""
        when = check_until(until, "until")
        check_limit(limit)
        place = shard_filter(shards, shard_count)
        found = await self._kept_pages(
            self.reads.due_schedules, when, (-1, ""), limit, place,
            lambda schedule: schedule.conversation_id, lambda row: (row[0].due or 0, row[0].id),
        )
        return cast("list[Schedule]", found)

    async def _kept_pages(
        self,
        read: Callable[..., Any],
        when: int,
        cursor: tuple[Any, ...],
        limit: int,
        place: ShardFilter | None,
        name_of: Callable[[Any], str],
        cursor_of: Callable[[Any], tuple[Any, ...]],
    ) -> list[Any]:
        """The first items (``row[0]``, shard ``row[1]``) of ``read(when, cursor, limit,
        shards)`` that ``place`` keeps, at most ``limit``, keyset-paged from ``cursor``
        (``cursor_of`` the last row) for at most ``_IDLE_PAGES`` pages."""
        if place is not None and not place.shards:
            return []
        wanted = None if place is None else place.wanted()
        found: list[Any] = []
        for _ in range(_IDLE_PAGES):  # rows of other shards must not end the page early
            rows = await self._reading(read, when, cursor, limit, wanted)
            for row in rows:
                if place is None or place.keeps(name_of(row[0]), row[1]):
                    found.append(row[0])
                    if len(found) == limit:
                        return found
            if len(rows) < limit:
                break
            cursor = cursor_of(rows[-1])
        return found

    async def next_due(
        self,
        *,
        after: int,
        shards: Sequence[int] | None = None,
        shard_count: int | None = None,
    ) -> int | None:
        """The soonest due time (epoch ms) after ``after`` of a pending schedule (of
        ``shards`` if given); None when none is pending. From the due index."""
        when = check_until(after, "after")
        place = shard_filter(shards, shard_count)
        if place is not None and not place.shards:
            return None
        wanted = None if place is None else place.wanted()
        for _ in range(_IDLE_PAGES):  # rows the filter leaves out (no shard column yet)
            rows = await self._reading(self.reads.next_due, when, _NEXT_PAGE, wanted)
            for due, name, shard in rows:
                if place is None or place.keeps(name, shard):
                    return int(due)
            if len(rows) < _NEXT_PAGE:
                return None
            when = rows[-1][0]
        return when  # still only others' rows: the caller looks again from there

def _stamped(item: Any, now: int) -> Any:
    """``item`` with ``created_at`` set to ``now`` when the caller left it 0."""
    return item if item.created_at else msgspec.structs.replace(item, created_at=now)


def _audit_row(call: object) -> ModelCall:
    """``call`` admitted (:func:`admit_model_call`), stamped with the time if it has none."""
    return cast(ModelCall, _stamped(admit_model_call(call), now_ms()))


_IDLE_PAGES = 8  # pages read by one idle_conversations call, at most (bounded)
_NEXT_PAGE = 64  # rows next_due reads at a time


async def _raising(error: Exception) -> NoReturn:
    raise error
