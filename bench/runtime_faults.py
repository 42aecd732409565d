"""A Runtime whose SQLite disk fills up, or whose files turn immutable: what callers see.

``--conversations`` conversations talk to a slow model (EchoModel with a delay per
chunk, so turns are in flight when the fault starts), each sending two messages per
round (the second is postponed behind the first) and awaiting both results. Then
the fault: a 4 MiB tmpfs filled up (``--fault full``) or ``chattr +i`` on the
database and its WAL (``--fault immutable``), for ``--seconds``, while the
conversations keep sending. Every send and every ``Turn.result()`` runs under a hang
guard (deadline + 10 s); each latency counts from the call or from the fault's start,
whichever is later. Then the fault is cleared and every conversation sends again.

Reported: the slowest send and result while the fault lasted (the promise:
``store_retry_deadline`` + 1 s), how many were refused, answered or hung, the
warning records torpor logged meanwhile (the promise: fewer than 100 in 30 s), the
time from clearing the fault to the first answer and to every conversation's
answer, and the acknowledged messages against the log (each exactly once, no
refused one). Needs root (mount, chattr; ``immutable`` needs ext4 under ``--dir``).

Usage: ``python bench/runtime_faults.py --fault full [--seconds 30] [--deadline 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import subprocess
import tempfile
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

from _common import emit, quiet, table

from torpor import EchoModel, Runtime, RuntimeConfig, StoreUnavailable, UserMessage

T = TypeVar("T")
MARGIN = 10.0  # the hang guard past the deadline


class Warnings(logging.Handler):
    """torpor's records at warning and above, by message."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counted = False
        self.events: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if self.counted:
            self.events[record.getMessage().split(" conversation_id", 1)[0][:60]] += 1


class Clock:
    """Latencies while the fault lasts: from the call, or from the fault's start."""

    def __init__(self, guard: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.guard = guard
        self.fault_at: float | None = None
        self.cleared_at: float | None = None
        self.slowest: dict[str, float] = {"send": 0.0, "result": 0.0}
        self.outcomes: collections.Counter[str] = collections.Counter()

    async def timed(self, what: str, wait: Awaitable[T]) -> T:
        """``wait`` under the hang guard; its outcome counted if it ends during the fault."""
        began = self.loop.time()
        outcome = "ok"
        try:
            async with asyncio.timeout(self.guard):
                return await wait
        except TimeoutError:
            outcome = "hung"
            raise
        except StoreUnavailable:
            outcome = "StoreUnavailable"
            raise
        except Exception as exc:
            outcome = type(exc).__name__
            raise
        finally:
            fault_at, cleared_at = self.fault_at, self.cleared_at
            if fault_at is not None and cleared_at is None:  # counted while the fault lasts
                self.slowest[what] = max(self.slowest[what],
                                         self.loop.time() - max(began, fault_at))
                self.outcomes[f"{what} {outcome}"] += 1


async def converse(rt: Runtime, clock: Clock, c: str, every: float, stop: asyncio.Event,
                   acked: dict[str, list[str]], refused: list[str],
                   blocked: list[Any]) -> None:
    """Two messages a round (the second postponed behind the first), both results awaited."""
    await asyncio.sleep(int(c[1:]) * 0.3)  # staggered: the fault finds each at another point
    n = 0
    while not stop.is_set():
        turns = []
        for part in ("a", "b"):
            text = f"{c} {n}{part}"
            try:
                turn = await clock.timed("send", rt.send(c, text))
            except StoreUnavailable:
                refused.append(text)
                continue
            except TimeoutError:
                continue  # hung: counted, and neither acknowledged nor refused
            acked[c].append(text)
            turns.append(turn)
        for turn in turns:
            try:
                await clock.timed("result", turn.result())
            except StoreUnavailable:
                if turn.postponed:
                    blocked.append(turn)  # logged: it runs once the store writes again
            except Exception:
                pass  # counted
        n += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def fill(rt: Runtime, where: Path) -> None:
    with contextlib.suppress(OSError), (where / "filler").open("ab") as out:
        while True:
            out.write(b"\0" * 4096)
            out.flush()
    for size in (20_000, 2_000, 200, 0):  # the room the database's pages still had
        for _ in range(200):
            try:
                await rt.store.append("~filler", [UserMessage("f" * size)])
            except StoreUnavailable:
                break


def chattr(flag: str, files: list[Path]) -> None:
    subprocess.run(["chattr", flag, *map(str, files)], check=True)


async def scenario(args: argparse.Namespace, where: Path) -> dict[str, Any]:
    handler = Warnings()
    logging.getLogger("torpor").addHandler(handler)
    path = where / "log.db"
    files = [path, Path(f"{path}-wal")]
    config = RuntimeConfig(store_retry_deadline=args.deadline)
    model = EchoModel(delay=args.delay, chunk_size=1)  # about 12 chunks a turn
    names = [f"c{i}" for i in range(args.conversations)]
    acked: dict[str, list[str]] = {c: [] for c in names}
    refused: list[str] = []
    blocked: list[Any] = []
    out: dict[str, Any] = {
        "fault": args.fault, "seconds": args.seconds, "conversations": args.conversations,
        "store_retry_deadline": args.deadline, "model_delay": args.delay,
    }
    async with Runtime(f"sqlite:///{path}", model=model, config=config) as rt:
        clock = Clock(args.deadline + MARGIN)
        loop = clock.loop
        stop = asyncio.Event()
        talkers = [asyncio.create_task(converse(rt, clock, c, args.every, stop, acked, refused,
                                                blocked)) for c in names]
        await asyncio.sleep(2.0)  # turns in flight
        handler.counted = True  # the store's first failure record included
        if args.fault == "full":
            await fill(rt, where)
        else:
            await asyncio.to_thread(chattr, "+i", files)
        clock.fault_at = loop.time()
        await asyncio.sleep(args.seconds)
        stop.set()  # each conversation ends its round, still under the fault
        await asyncio.gather(*talkers)
        handler.counted = False
        out["fault_lasted_s"] = round(loop.time() - clock.fault_at, 2)
        out["warnings"] = sum(handler.events.values())
        out["warning_records"] = dict(handler.events)
        out["max_send_s"] = round(clock.slowest["send"], 3)
        out["max_result_s"] = round(clock.slowest["result"], 3)
        out["during_fault"] = dict(clock.outcomes)
        if args.fault == "full":
            (where / "filler").unlink()
        else:
            await asyncio.to_thread(chattr, "-i", files)
        model.delay = 0.0  # from now on the answers' times are the runtime's own
        cleared = clock.cleared_at = loop.time()

        answered: list[float] = []

        async def again(c: str) -> None:
            turn = await rt.send(c, f"{c} after")
            acked[c].append(f"{c} after")
            await turn.result()
            answered.append(loop.time() - cleared)

        later: collections.Counter[str] = collections.Counter()
        async with asyncio.timeout(args.deadline + MARGIN):
            await asyncio.gather(*(again(c) for c in names))
            for turn in blocked:  # postponed, told StoreUnavailable: asked again now
                try:
                    await turn.result()
                    later["answered"] += 1
                except StoreUnavailable:  # it had started: its answer could not be logged
                    later["ran during the fault, aborted"] += 1
        out["first_answer_after_clearing_s"] = round(min(answered), 3)
        out["every_answer_after_clearing_s"] = round(max(answered), 3)
        out["postponed_refused_then"] = dict(later)
        logged: dict[str, list[str]] = {}
        for c in names:
            logged[c] = [e.body.text for e in await rt.store.read_since(c, 0)
                         if isinstance(e.body, UserMessage)]
        out["acknowledged"] = sum(map(len, acked.values()))
        out["logged"] = sum(map(len, logged.values()))
        out["refused"] = len(refused)
        out["every_ack_once_in_order"] = logged == acked
        out["refused_in_log"] = len(set(refused) & {t for ts in logged.values() for t in ts})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault", choices=["full", "immutable"], default="full")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--deadline", type=float, default=5.0, help="store_retry_deadline")
    parser.add_argument("--delay", type=float, default=0.05, help="model delay per chunk")
    parser.add_argument("--every", type=float, default=0.25, help="seconds between rounds")
    parser.add_argument("--dir", default=None, help="where the files go (default: /tmp)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    quiet()
    base = Path(tempfile.mkdtemp(prefix="torpor-runtime-faults-", dir=args.dir))
    where = base / "fs"
    where.mkdir()
    mounted = args.fault == "full"
    if mounted:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], check=True)
    try:
        out = asyncio.run(scenario(args, where))
    finally:
        if args.fault == "immutable":
            for name in ("log.db", "log.db-wal"):
                subprocess.run(["chattr", "-i", str(where / name)], capture_output=True)
        if mounted:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
    rows = [(key, str(value)) for key, value in out.items()]
    emit(out, [table(f"runtime faults: {args.fault}", ["measure", "value"], rows)], args.json)


if __name__ == "__main__":
    main()
