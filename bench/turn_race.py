"""Turn numbers under concurrent senders and slow commits (issue 19: the turn collision).

For ``--seconds`` D, ``--senders`` N tasks per conversation send to each of
``--conversations`` C conversations, each waiting a random jitter (up to
``--jitter`` ms) before every send and for the answer after it (not with
``--open-loop``: then the mailbox bound refuses most sends), while a random
share (``--delay-share``) of the store's writes is held back up to
``--max-delay`` ms (before reaching the store or after their commit:
``tests/held_writes.py`` wraps the real store's write methods). The model
answers at once (EchoModel, a chunk every ``--model-delay`` ms), so sends land
mid-turn, between turns and on the seams. Every acknowledged turn is awaited
(up to ``--wait`` s); then each conversation's log is read back.

Reported per store (and run): sends acknowledged, sends refused (Busy: the
mailbox bound; AgentParked; other errors), turn numbers given to more than one
user message (``repeated_turns``) or falling with position, parked
conversations, crashes, and acknowledged turns left unanswered (aborted, or no
end within the wait). The promise: 0 repeated, 0 parked, 0 unanswered.

SQLite is a file in a temporary directory; PostgreSQL a fresh database on a
throwaway cluster (``tests/pg_cluster.py``) unless ``--url`` names a server.

Usage: ``python bench/turn_race.py [--store sqlite,postgres] [--senders 4]
[--conversations 1] [--seconds 5] [--runs 1] [--jitter 30] [--delay-share 0.5]
[--max-delay 20] [--seed N] [--open-loop] [--json FILE]``. The issue's checks:
``--senders 4 --seconds 30 --runs 10`` (four senders on one conversation) and
``--store sqlite,postgres --conversations 8 --seconds 30`` (thousands of sends).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import ROOT, emit, quiet, table

sys.path.insert(0, str(ROOT / "tests"))
from held_writes import Delay, HeldWrites, Write
from pg_cluster import running_cluster

from torpor import (
    AgentParked,
    AssistantMessage,
    Busy,
    EchoModel,
    Parked,
    Runtime,
    RuntimeConfig,
    Turn,
    TurnAborted,
    UserMessage,
)


class Delays:
    """Holds back a random share of writes, each up to ``max_ms``; counts them."""

    def __init__(self, rng: random.Random, share: float, max_ms: float) -> None:
        self.rng, self.share, self.max_ms = rng, share, max_ms
        self.delayed = 0

    def __call__(self, write: Write) -> Delay | None:
        if self.rng.random() >= self.share:
            return None
        self.delayed += 1
        return Delay(seconds=self.rng.uniform(0, self.max_ms) / 1000,
                     after=self.rng.random() < 0.5)


async def sender(
    rt: Runtime, cid: str, name: str, until: float, rng: random.Random,
    args: argparse.Namespace, acked: list[Turn], refused: Counter[str], ends: Counter[str],
) -> None:
    """Send after a random jitter; wait for the answer (``--open-loop``: do not); repeat."""
    n = 0
    while time.monotonic() < until:
        await asyncio.sleep(rng.uniform(0, args.jitter) / 1000)
        n += 1
        try:
            async with asyncio.timeout(args.wait):
                turn = await rt.send(cid, f"{name}-{n}")
        except TimeoutError:
            refused["send hung"] += 1
            continue
        except Busy:
            refused["busy"] += 1
            continue
        except AgentParked:
            refused["parked"] += 1
            continue
        except Exception as exc:
            refused[type(exc).__name__] += 1
            continue
        acked.append(turn)
        if not args.open_loop:
            ends[await outcome(turn, time.monotonic() + args.wait)] += 1


async def outcome(turn: Turn, deadline: float) -> str:
    try:
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            result = await turn.result()
    except TimeoutError:
        return "no end"
    except TurnAborted as exc:
        return f"aborted: {exc.reason}"
    except Exception as exc:
        return f"failed: {type(exc).__name__}"
    return "answered" if isinstance(result, AssistantMessage) else "suspended"


async def one_run(url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    delays = Delays(rng, args.delay_share, args.max_delay)
    cids = [f"r{seed}-c{i}" for i in range(args.conversations)]  # new ones on a reused --url
    acked: dict[str, list[Turn]] = {cid: [] for cid in cids}
    refused: Counter[str] = Counter()
    ends: Counter[str] = Counter()
    model = EchoModel(chunk_size=4, delay=args.model_delay / 1000)
    config = RuntimeConfig(backoff_initial=0.01, backoff_max=0.1)
    async with Runtime(url, model=model, config=config) as rt:
        with HeldWrites(rt.store, delays):
            until = time.monotonic() + args.seconds
            senders = [
                sender(rt, cid, f"{cid}s{s}", until, random.Random(rng.random()), args,
                       acked[cid], refused, ends)
                for cid in cids for s in range(args.senders)
            ]
            await asyncio.gather(*senders)
            if args.open_loop:
                deadline = time.monotonic() + args.wait
                ends.update(await asyncio.gather(
                    *(outcome(turn, deadline) for cid in cids for turn in acked[cid])))
        repeated = falling = parked = 0
        for cid in cids:
            events = await rt.store.read_since(cid, 0)
            turns = [e.turn for e in events if isinstance(e.body, UserMessage)]
            repeated += sum(n - 1 for n in Counter(turns).values() if n > 1)
            falling += sum(1 for a, b in itertools.pairwise(turns) if b < a)
            info = await rt.admin.inspect(cid)
            if info.state == "parked" or any(isinstance(e.body, Parked) for e in events):
                parked += 1
        stats = await rt.admin.stats()
    sends = sum(len(t) for t in acked.values())
    return {
        "seed": seed,
        "sends_acknowledged": sends,
        "refused": dict(refused),
        "repeated_turns": repeated,
        "falling_turns": falling,
        "parked_conversations": parked,
        "crashes": stats.crashes,
        "unanswered_turns": sends - ends["answered"],
        "turn_ends": dict(ends),
        "writes_delayed": delays.delayed,
    }


@contextlib.contextmanager
def databases(store: str, args: argparse.Namespace) -> Iterator[Any]:
    """Yields a function giving a fresh store URL per run."""
    if store == "sqlite":
        with tempfile.TemporaryDirectory(prefix="torpor-turn-race-") as directory:
            yield lambda: f"sqlite:///{Path(directory) / uuid.uuid4().hex}.db"
        return
    if args.url:
        yield lambda: args.url  # a server of one's own: one database, new conversations
        return
    with running_cluster(fsync=not args.no_fsync) as pg:
        yield lambda: pg.url()


async def fresh_pg_database(server_url: str) -> str:
    import asyncpg

    name = "turn_race_" + uuid.uuid4().hex[:10]
    conn = await asyncpg.connect(server_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return server_url.rsplit("/", 1)[0] + "/" + name


async def main(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for store in args.store.split(","):
        runs = []
        with databases(store, args) as url_for:
            for run in range(args.runs):
                url = url_for()
                if store == "postgres" and not args.url:
                    url = await fresh_pg_database(url)
                runs.append(await one_run(url, args, args.seed + run))
                r = runs[-1]
                print(f"{store} run {run + 1}/{args.runs}: {r['sends_acknowledged']} sends, "
                      f"{r['repeated_turns']} repeated turns, {r['parked_conversations']} "
                      f"parked, {r['unanswered_turns']} unanswered", file=sys.stderr)
        total = {key: sum(r[key] for r in runs) for key in (
            "sends_acknowledged", "repeated_turns", "falling_turns", "parked_conversations",
            "crashes", "unanswered_turns", "writes_delayed")}
        total["runs_with_repeats"] = sum(1 for r in runs if r["repeated_turns"])
        total["runs_with_parked"] = sum(1 for r in runs if r["parked_conversations"])
        results[store] = {"total": total, "runs": runs}
    return {
        "benchmark": "turn_race",
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "url")},
        "results": results,
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="sqlite", help="sqlite, postgres or both (comma)")
    parser.add_argument("--senders", type=int, default=4, help="per conversation")
    parser.add_argument("--conversations", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=5.0, help="sending, per run")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--jitter", type=float, default=30.0, help="ms before each send, max")
    parser.add_argument("--delay-share", type=float, default=0.5, help="of writes delayed")
    parser.add_argument("--max-delay", type=float, default=20.0, help="ms a write is held, max")
    parser.add_argument("--model-delay", type=float, default=0.5, help="ms per answer chunk")
    parser.add_argument("--wait", type=float, default=10.0, help="s for a send or turn to end")
    parser.add_argument("--open-loop", action="store_true",
                        help="send again without waiting for the answer (hits mailbox_bound)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--url", help="a PostgreSQL database to use instead of a cluster")
    parser.add_argument("--no-fsync", action="store_true", help="the throwaway cluster's")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    quiet()
    data = asyncio.run(main(args))
    rows = []
    for store, result in data["results"].items():
        t = result["total"]
        rows.append((store, args.runs, t["sends_acknowledged"], t["repeated_turns"],
                     t["runs_with_repeats"], t["parked_conversations"], t["crashes"],
                     t["unanswered_turns"], t["writes_delayed"]))
    title = (f"{args.senders} senders x {args.conversations} conversations, "
             f"{args.seconds:g} s per run, {args.delay_share:.0%} of writes delayed "
             f"up to {args.max_delay:g} ms")
    emit(data, [table(title, ["store", "runs", "sends acked", "repeated turns",
                              "runs with repeats", "parked", "crashes", "unanswered",
                              "writes delayed"], rows)], args.json)


if __name__ == "__main__":
    cli()
