"""One group-commit transaction on PostgreSQL: lock, plan, create, write, commit.

Bulk mode (the normal path), in one transaction: four round trips (BEGIN,
LOCK, WRITE, COMMIT) whatever the batch holds, two more when it creates
conversations:

1. ``LOCK``: the batch's existing conversations, ``FOR UPDATE`` in key order,
   with their heads and the idempotency keys the batch asks about. Another
   writer holding one of them makes us wait for its commit; we then read the
   head it left. So positions stay dense and unique across processes, and a
   stale ``expect_head`` is refused with ConflictError. On a clustered node
   (appends carrying a fence) the same statement also reads the lease rows of
   the batch's shards ``FOR SHARE`` (``LOCK_FENCED``): an append whose epoch
   is not the current one fails alone with FencedError, no extra round trip.
2. Plan every operation against that view (pure, no I/O; see :mod:`.plan`).
3. ``CREATE`` the conversations kept plans need; if another writer created one
   of them meanwhile, lock it, read it and plan again.
4. ``WRITE``: every row and every new head in one statement; then COMMIT.

Deadlocks. Step 1 locks in one global order (conversation key), so batches
that only touch existing conversations cannot deadlock. Step 3 can: inserting
a name another uncommitted batch inserted waits for that batch, and re-locking
a conversation someone else created is out of key order. Measured under a
stress of three stores creating the same new conversations concurrently, that
happened about once per 100 batches and cost PostgreSQL's ``deadlock_timeout``
(1 s) each time. So step 3 runs under ``SET LOCAL lock_timeout`` (:data:`STEP3_LOCK_TIMEOUT`):
a wait that long means contention on a conversation being created, and the
batch rolls back and retries after a short random backoff, by which time the
other batch has committed and the rows are locked in order in step 1. A
detected deadlock or a serialization failure retries the same way.

If a write fails for a reason a retry cannot fix (it should not: plans are
validated; a trigger, a corrupt index, an out-of-band row might), the batch is
replayed in *isolated* mode: each operation in its own SAVEPOINT, so only the
operation that fails is rolled back and told.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from torpor._logging import get_logger
from torpor.errors import StoreError
from torpor.store.commit_queue import Failed
from torpor.store.postgres.errors import is_unavailable
from torpor.store.postgres.plan import ConvState, Plan, ReplayEvents, View, WriteOp
from torpor.store.postgres.statements import (
    CREATE,
    LOCK,
    LOCK_FENCED,
    LOCK_SCHEDULES,
    write,
    write_pending,
)
from torpor.store.rows import EVENT_COLUMNS, check_reaches, to_events

__all__ = ["BatchStats", "Failed", "run_batch"]

log = get_logger(__name__)

STEP3_LOCK_TIMEOUT = "200ms"
_RETRIES = 12
_RETRYABLE = (
    asyncpg.DeadlockDetectedError,
    asyncpg.SerializationError,
    asyncpg.LockNotAvailableError,
)


@dataclass(slots=True)
class BatchStats:
    """How often batches needed the slow paths (both should stay near zero)."""

    retries: int = 0  # contention: a deadlock, a lock timeout, a serialization failure
    isolated: int = 0  # a write the database refused: replayed op by op


async def run_batch(
    conn: asyncpg.Connection, ops: Sequence[WriteOp], now: int, stats: BatchStats
) -> list[object]:
    """Commit ``ops`` in one transaction; each gets its result or :class:`Failed`.

    Raises (for every op at once) only when the connection itself failed or the
    isolated replay could not run; then nothing of the batch is committed, or,
    if the connection broke during COMMIT, the outcome is unknown.
    """
    isolated = False
    for attempt in range(_RETRIES):
        try:
            async with conn.transaction():
                if isolated:
                    return await _isolated(conn, ops, now)
                return await _bulk(conn, ops, now)
        except _RETRYABLE as exc:
            log.debug("batch_retry", attempt=attempt, ops=len(ops), error=repr(exc))
            stats.retries += 1
            await asyncio.sleep(random.uniform(0.001, 0.004) * min(2**attempt, 64))
        except asyncpg.PostgresError as exc:
            if conn.is_closed() or isolated or is_unavailable(exc):
                raise  # nobody's fault but the database's: the whole batch fails
            log.debug("batch_isolated", ops=len(ops), error=repr(exc))
            stats.isolated += 1
            isolated = True
    raise StoreError(f"batch of {len(ops)} operations still contended after {_RETRIES} tries")


async def _load(conn: asyncpg.Connection, view: View, ops: Sequence[WriteOp]) -> None:
    """Lock and read the conversations of ``ops`` (and their idempotency keys) into ``view``."""
    names = sorted({op.conversation_id for op in ops})
    keys = sorted({op.idempotency_key for op in ops if op.idempotency_key is not None})
    shards = sorted({fence[0] for op in ops if (fence := getattr(op, "fence", None)) is not None})
    if not shards:  # a single node (or no append): the statement it always was
        rows = await conn.fetch(LOCK, names, keys)
    else:  # the same round trip also share-locks the shards' lease rows (see LOCK_FENCED)
        rows = await conn.fetch(LOCK_FENCED, names, keys, shards)
    for key, name, head, idem, first, count, mark, body, *lease in rows:
        if name is None:
            view.epochs[lease[0]] = lease[1]
            continue
        view.states[name] = ConvState(key, head)
        if idem is not None:
            view.stored_keys[(name, idem)] = (first, count, mark, body)
    fired = sorted({
        fire.schedule_id for op in ops
        if (fire := getattr(getattr(op, "append", None), "fired", None)) is not None
    })
    if fired:  # locked after the conversations, as a delete locks them (no cycle)
        for sid, name, due, key in await conn.fetch(LOCK_SCHEDULES, fired):
            view.schedules[sid] = (name, due, key)


async def _create(conn: asyncpg.Connection, view: View, names: list[str]) -> list[str]:
    """Insert the rows of ``names``; return those another writer created first."""
    if not view.creating:  # from here on, a long lock wait means retry (see the module doc)
        await conn.execute(f"SET LOCAL lock_timeout = '{STEP3_LOCK_TIMEOUT}'")
        view.creating = True
    rows = await conn.fetch(CREATE, names, [view.shards.get(n) for n in names], view.now)
    view.created({name: key for key, name in rows})
    return [name for name in names if name not in view.states]


def _plan(view: View, op: WriteOp) -> Plan | Failed:
    try:
        return op.plan(view)
    except Exception as exc:  # refused: a conflict, a bad checkpoint
        return Failed(exc)


async def _bulk(conn: asyncpg.Connection, ops: Sequence[WriteOp], now: int) -> list[object]:
    view = View(now)
    await _load(conn, view, ops)
    while True:
        view.begin()
        results: list[object] = []
        for op in ops:
            plan = _plan(view, op)
            if isinstance(plan, Failed):
                results.append(plan)
                continue
            view.keep(plan)
            results.append(plan.result)
        needed = view.needed()
        if not needed:
            break
        raced = await _create(conn, view, needed)
        if not raced:
            break
        await _load(conn, view, [op for op in ops if op.conversation_id in set(raced)])
    await write(conn, view.writes, view.heads, view.key_of, now)
    if view.pending:
        await write_pending(conn, view.pending)
    return await _replays(conn, view, results)


async def _isolated(conn: asyncpg.Connection, ops: Sequence[WriteOp], now: int) -> list[object]:
    view = View(now)
    await _load(conn, view, ops)
    results: list[object] = []
    for op in ops:
        existed = op.conversation_id in view.states
        try:
            async with conn.transaction():  # a SAVEPOINT
                plan = await _isolated_one(conn, view, op)
        except asyncpg.PostgresError as exc:
            if conn.is_closed() or isinstance(exc, _RETRYABLE) or is_unavailable(exc):
                raise
            if not existed:  # its row, if this op created it, was rolled back too
                view.states.pop(op.conversation_id, None)
            error = StoreError(f"write to {op.conversation_id!r} failed: {exc}")
            error.__cause__ = exc
            results.append(Failed(error))
            continue
        if isinstance(plan, Failed):
            results.append(plan)
            continue
        view.keep(plan)
        results.append(plan.result)
    if view.pending:
        await write_pending(conn, view.pending)
    return await _replays(conn, view, results)


async def _isolated_one(conn: asyncpg.Connection, view: View, op: WriteOp) -> Plan | Failed:
    plan = _plan(view, op)
    if isinstance(plan, Failed):
        return plan
    creating = plan.name is not None and plan.name not in view.states
    if creating and plan.name is not None and await _create(conn, view, [plan.name]):
        await _load(conn, view, [op])  # raced: another writer created it; plan again
        plan = _plan(view, op)
        if isinstance(plan, Failed):
            return plan
    if plan.writes is not None:
        name = plan.name
        heads = {} if name is None or plan.head is None else {name: plan.head}
        await write(conn, plan.writes, heads, view.key_of, view.now)
    return plan


async def _replays(conn: asyncpg.Connection, view: View, results: list[object]) -> list[object]:
    """Read the stored events of keyed appends replayed from earlier batches."""
    for index, result in enumerate(results):
        if isinstance(result, ReplayEvents):
            rows = await conn.fetch(
                f"SELECT {EVENT_COLUMNS} FROM events WHERE conversation_id = $1 "
                "AND position BETWEEN $2 AND $3 ORDER BY position",
                view.key_of(result.conversation_id),
                result.first,
                result.first + result.count - 1,
            )
            try:
                events = to_events(result.conversation_id, rows, result.first)
                check_reaches(
                    result.conversation_id, events, result.first, result.first + result.count - 1
                )
                results[index] = events
            except StoreError as exc:
                results[index] = Failed(exc)
    return results
