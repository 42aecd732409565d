"""The embedding worker: vectors for hybrid recall, made off the hot path.

A turn never waits for an embedder. Like the search backlog, which leaves the
full-text rows of small commits to be indexed later in bulk, the vectors are
made afterwards, in batches, by one task the runtime owns (started on entry,
cancelled and awaited on exit). Woken by this runtime's appends (at most every
``PASS_GAP`` seconds, so a burst of appends lands in one pass) and at least
every ``embed_interval`` seconds (appends by other processes), it asks the
store which conversations' logs go beyond their progress mark
(:meth:`~torpor.store.vectors.VectorIndex.lagging`), reads their new events,
embeds the searchable ones and stores the vectors with the new mark in one
write. Until then full-text search covers those events (see
:mod:`torpor.compaction.fusion`). The marks are in the store, so a restart
(or another process on the same PostgreSQL) carries on where the last left off.

A conversation's step runs under the runtime's erasure guard
(:meth:`torpor.runtime.erase.Erasure.guard`): a delete of it cancels the step and
waits for it, so no vector of a deleted conversation lands after its delete (nor
in a new conversation started under the same id afterwards).

An embedder that fails (down, rate-limited) costs nothing but lag: the
conversation is tried again at the next pass, and the failure is counted and
logged, never raised into a turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, AsyncExitStack
from typing import Any

import anyio
import msgspec

from torpor.compaction.fusion import HybridRecall
from torpor.errors import ConversationDeleted, StoreError
from torpor.events import AssistantMessage, ToolResult, UserMessage, searchable_text
from torpor.llm.embedding import Embedder, check_vectors, space_of
from torpor.store.protocol import EventStore
from torpor.store.vectors import VectorIndex, vector_index

__all__ = ["EmbeddingStats", "EmbeddingWorker", "start_embedding"]

READ_CHUNK = 256  # positions read (and marked done) per step of one conversation
LAGGING_PAGE = 100  # conversations asked for per query
MAX_CHARS = 8_000  # of an event's text sent to the embedder (endpoints cap their input)

PASS_GAP = 0.05  # seconds between passes at least: appends arriving meanwhile share one

_EMBEDDED = (UserMessage, AssistantMessage, ToolResult)

Guard = Callable[[str], AbstractContextManager[object]]
"""Work on one conversation, ended by its delete (torpor.runtime.erase.Erasure.guard)."""


class EmbeddingStats(msgspec.Struct, frozen=True):
    """What the embedding worker has done since the runtime started."""

    space: str  # the embedder's vector space (name/dimensions)
    backend: str  # how nearest neighbours are computed (see torpor.store.vectors)
    embedded: int  # events embedded
    passes: int  # passes over the lagging conversations
    failures: int  # conversations whose embedding failed (tried again at the next pass)
    last_error: str | None
    last_pass_ms: float | None  # how long the last pass that embedded something took


class EmbeddingWorker:
    """Embeds what the log holds and the vectors do not, pass after pass."""

    def __init__(
        self,
        store: EventStore,
        embedder: Embedder,
        vectors: VectorIndex,
        *,
        interval: float,
        batch: int = 64,
        log: Any,
        guard: Guard | None = None,
    ) -> None:
        self.store = store
        self.embedder = embedder
        self.vectors = vectors
        self.space = space_of(embedder)
        self.interval = interval
        self.batch = batch
        self._log = log
        self._guard = guard
        self._embedded = self._passes = self._failures = 0
        self._last_error: str | None = None
        self._last_pass_ms: float | None = None
        self._pass = asyncio.Lock()
        self._wake = asyncio.Event()

    def poke(self) -> None:
        """Events were logged: embed them soon (called on every append; costs a flag)."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self.catch_up()
            with anyio.move_on_after(self.interval):
                await self._wake.wait()
            await anyio.sleep(PASS_GAP)  # a debounce, not a wait for anything
            self._wake.clear()

    async def catch_up(self) -> int:
        """One pass: embed every lagging conversation once; the events embedded.

        A conversation that fails stays lagging for the next pass (not this one:
        a pass ends even while an embedder is down). Passes never overlap (the timer's
        and an operator's would embed the same events twice)."""
        async with self._pass:
            return await self._catch_up()

    async def _catch_up(self) -> int:
        started = time.perf_counter()
        self._passes += 1
        done = 0
        failed: set[str] = set()
        while True:
            try:
                lagging = await self.vectors.lagging(self.space, LAGGING_PAGE + len(failed))
            except StoreError as exc:
                self._failed("", exc)
                break
            todo = [(name, mark) for name, mark in lagging if name not in failed]
            if not todo:
                break
            for name, mark in todo:
                try:
                    done += await self._guarded(name, mark)
                except ConversationDeleted:  # being deleted: nothing to embed, no failure
                    failed.add(name)
                except Exception as exc:  # the embedder is the host's code: anything goes
                    failed.add(name)
                    self._failed(name, exc)
        if done:
            self._last_pass_ms = (time.perf_counter() - started) * 1000
        return done

    def _failed(self, conversation_id: str, exc: BaseException) -> None:
        self._failures += 1
        self._last_error = f"{type(exc).__name__}: {exc}"
        self._log.warning(
            "embedding_failed", conversation=conversation_id, error=self._last_error
        )

    async def _guarded(self, conversation_id: str, mark: int) -> int:
        if self._guard is None:
            return await self._conversation(conversation_id, mark)
        with self._guard(conversation_id):
            return await self._conversation(conversation_id, mark)
        return 0  # cancelled by the conversation's delete

    async def _conversation(self, conversation_id: str, mark: int) -> int:
        """Embed the conversation's events after ``mark`` up to its head now."""
        done = 0
        while True:
            events = await self.store.read_range(
                conversation_id, mark + 1, mark + READ_CHUNK
            )
            if not events:
                return done
            todo = [
                (event.position, searchable_text(event.body)[:MAX_CHARS])
                for event in events
                if isinstance(event.body, _EMBEDDED)
            ]
            todo = [(position, text) for position, text in todo if text.strip()]
            rows: list[tuple[int, list[float]]] = []
            for start in range(0, len(todo), self.batch):
                part = todo[start : start + self.batch]
                texts = [text for _, text in part]
                vectors = check_vectors(self.embedder, texts, await self.embedder.embed(texts))
                rows.extend(
                    (position, vector) for (position, _), vector in zip(part, vectors, strict=True)
                )
            mark = events[-1].position
            await self.vectors.put(conversation_id, self.space, rows, mark)
            self._embedded += len(rows)
            done += len(rows)

    def stats(self) -> EmbeddingStats:
        return EmbeddingStats(
            space=self.space,
            backend=self.vectors.backend,
            embedded=self._embedded,
            passes=self._passes,
            failures=self._failures,
            last_error=self._last_error,
            last_pass_ms=self._last_pass_ms,
        )


def start_embedding(
    store: EventStore, embedder: Embedder, interval: float, log: Any, stack: AsyncExitStack,
    *, guard: Guard | None = None,
) -> tuple[EmbeddingWorker, HybridRecall]:
    """Start the worker as a task ``stack`` cancels and awaits on exit; and the recall that
    reads its vectors."""
    vectors = vector_index(store)
    worker = EmbeddingWorker(store, embedder, vectors, interval=interval, log=log, guard=guard)
    task = asyncio.get_running_loop().create_task(worker.run(), name="torpor-embedding")
    stack.push_async_callback(_cancel_and_wait, task)
    return worker, HybridRecall(embedder, vectors)


async def _cancel_and_wait(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
