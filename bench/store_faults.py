"""A SQLite store whose disk fills up, or whose files turn immutable: what it does meanwhile.

Five conversations write until the fault stops them: a 4 MiB tmpfs filled up
(``--fault full``) or ``chattr +i`` on the database and its WAL (``--fault
immutable``). Then, for ``--seconds``, one append every ``--every`` seconds (each
given 10 s before it counts as hung), while the WAL checkpointer does whatever it
does when idle after ``--idle`` seconds. Reported: the log records by event name and
how many were warnings or worse, the checkpoints attempted (counted where
``PRAGMA wal_checkpoint`` runs), the appends refused, accepted or hung, the slowest
append, the process CPU time; then the fault is cleared, one more append must
succeed, and every acknowledged row must be in the log exactly once.

Needs root (mount, chattr) and, for ``immutable``, a filesystem with the immutable
attribute (ext4) under ``--dir``. Usage: ``python bench/store_faults.py --fault full
[--seconds 10] [--idle 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import emit, table

import torpor.store.sqlite.checkpoint as checkpoint_module
from torpor import StoreUnavailable
from torpor.events import UserMessage
from torpor.store import SQLiteStore

BIG = "words that take room " * 1000  # ~20 KB: each append needs new pages
HANG = 10.0


class Count(logging.Handler):
    """torpor's records by event name (info and above)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.events: collections.Counter[str] = collections.Counter()
        self.warnings = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.events[record.getMessage().split(" ", 1)[0]] += 1
        self.warnings += record.levelno >= logging.WARNING


def count_checkpoints() -> list[int]:
    """[checkpoints attempted]: wraps the function each checkpoint runs on its thread."""
    attempts = [0]
    real = checkpoint_module._wal_checkpoint

    def counted(conn: Any, mode: Any) -> tuple[int, int, int]:
        attempts[0] += 1
        return real(conn, mode)

    checkpoint_module._wal_checkpoint = counted
    return attempts


def chattr(flag: str, files: list[Path]) -> None:
    subprocess.run(["chattr", flag, *map(str, files)], check=True)


async def scenario(args: argparse.Namespace, where: Path) -> dict[str, Any]:
    attempts = count_checkpoints()
    handler = Count()
    logger = logging.getLogger("torpor")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    path = where / "log.db"
    files = [path, Path(f"{path}-wal")]
    acked: dict[str, list[str]] = collections.defaultdict(list)
    out: dict[str, Any] = {"fault": args.fault, "seconds": args.seconds, "idle": args.idle}
    async with SQLiteStore(str(path), idle_checkpoint=args.idle) as store:
        for c in range(5):
            await store.append(f"c{c}", [UserMessage("hello")])
            acked[f"c{c}"].append("hello")
        if args.fault == "full":
            with contextlib.suppress(OSError), (where / "filler").open("wb") as out_file:
                while True:
                    out_file.write(b"\0" * 4096)
                    out_file.flush()
            n = 0
            while True:  # the conversations stream until the last room is gone
                text = f"{n} {BIG}"
                try:
                    await asyncio.wait_for(store.append(f"c{n % 5}", [UserMessage(text)]), HANG)
                except StoreUnavailable:
                    break
                acked[f"c{n % 5}"].append(text)
                n += 1
        else:
            await asyncio.to_thread(chattr, "+i", files)
        handler.events.clear()
        handler.warnings = 0
        attempts[0] = 0
        loop = asyncio.get_running_loop()
        cpu, start = time.process_time(), loop.time()
        outcomes: collections.Counter[str] = collections.Counter()
        slowest = 0.0
        i = 0
        while loop.time() - start < args.seconds:
            began = loop.time()
            try:
                await asyncio.wait_for(store.append(f"c{i % 5}", [UserMessage(f"x{i}")]), HANG)
                outcomes["accepted"] += 1
                acked[f"c{i % 5}"].append(f"x{i}")
            except StoreUnavailable:
                outcomes["refused"] += 1
            except TimeoutError:
                outcomes["hung"] += 1
            slowest = max(slowest, loop.time() - began)
            i += 1
            await asyncio.sleep(args.every)
        out["window_s"] = round(loop.time() - start, 2)
        out["cpu_s"] = round(time.process_time() - cpu, 3)
        out["checkpoints_attempted"] = attempts[0]
        out["records"] = dict(handler.events)
        out["warnings"] = handler.warnings
        out["appends"] = dict(outcomes)
        out["slowest_append_s"] = round(slowest, 3)
        if args.fault == "full":
            (where / "filler").unlink()
        else:
            await asyncio.to_thread(chattr, "-i", files)
        began = loop.time()
        try:
            await asyncio.wait_for(store.append("c0", [UserMessage("after")]), HANG)
            acked["c0"].append("after")
            out["after_clearing"] = f"accepted in {loop.time() - began:.3f} s"
        except (StoreUnavailable, TimeoutError) as exc:
            out["after_clearing"] = repr(exc)
        stored = {c: [e.body.text for e in await store.read_since(c, 0)] for c in acked}  # type: ignore[union-attr]
        out["every_ack_once"] = stored == acked
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault", choices=["full", "immutable"], default="full")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--idle", type=float, default=5.0, help="the store's idle_checkpoint")
    parser.add_argument("--every", type=float, default=0.25, help="seconds between appends")
    parser.add_argument("--dir", default=None, help="where the files go (default: /tmp)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="torpor-faults-", dir=args.dir))
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
    emit(out, [table(f"store faults: {args.fault}", ["measure", "value"], rows)], args.json)


if __name__ == "__main__":
    main()
