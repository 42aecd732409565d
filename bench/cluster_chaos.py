"""Chaos on a torpor cluster (issue 20): real nodes, real faults, a client load, then the log.

Three ``torpor serve --node-id`` processes on a throwaway PostgreSQL 15
(``tests/pg_cluster.py``) serve a bounded client load (``bench/_chaos_load.py``:
``--clients`` clients, ``--conversations`` conversations, sends to random nodes with
``Idempotency-Key``, retried across nodes on 503/421/network errors, each turn's SSE
read through to its end) while a schedule of fault windows runs, ``--rounds`` times:

* ``kill9``: SIGKILL of a node, restarted under the same id once its shards are served
  by the others;
* ``sigstop``: SIGSTOP of a node for ``--pause`` seconds (past the lease TTL), then
  SIGCONT;
* ``join``: a node joins (the lowest free id: a fourth node, or one that left);
* ``leave``: SIGTERM (graceful leave) of a node other than the one that joined last,
  drained from the clients' list first;
* ``pgstop``: ``pg_ctl stop`` for ``--pg-down`` seconds, then start;
* ``pgrestart``: ``pg_ctl restart``.

Victims are drawn with ``--seed``. Before ``kill9`` and ``sigstop``, ``--planted``
conversations of the victim get a long turn and a postponed message (202) and are then
left alone, so only the new owner can end them (issue 20, item 3).

Per window: requests, client-visible errors by kind (any 500 counted apart), sends
acknowledged, seconds until every shard is served again and until the lease table is
balanced (rendezvous hashing over the live nodes), takeovers (the nodes'
``/admin/cluster`` counters) and epoch moves (the lease table), and shards still
orphaned at its end (a live lease row whose owner does not serve the shard). Then the
load stops; the run waits for every turn to end with no new request (``quiet``: work
left by a takeover must be re-driven), every conversation answers once more, and
``bench/_chaos_check.py`` checks the log in PostgreSQL: acknowledged messages present
exactly once, positions dense, epochs never going down, nothing parked or unended.

``--mode handover``: joins and leaves only, under turns of ``--turn-seconds`` (5 by
default): the client error rate per join and leave (the issue's target: at most 0.1%)
and a joining node's time from registering to its first shard (target: one lease
refresh, ``min(1, ttl/4)`` s).

Usage: ``python bench/cluster_chaos.py [--quick] [--mode chaos|handover] [--rounds N]
[--clients N] [--conversations N] [--ttl S] [--faults kill9 sigstop ...] [--json FILE]``.
``--quick`` is a small run (about a minute). Prints tables and one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, emit, quiet, table

sys.path.insert(0, str(ROOT / "tests"))
from _chaos_check import check, unended
from _chaos_load import Load, Window
from _chaos_nodes import Nodes
from _chaos_table import Table
from pg_cluster import running_cluster

from torpor.cluster import shard_of
from torpor.store.postgres import PostgresStore

FAULTS = ("kill9", "sigstop", "join", "leave", "pgstop", "pgrestart")
_ECHO_PREFIX = len("echo: ")
_CHUNK = 16  # EchoModel's chunk size: its delay is awaited once per chunk


@dataclass
class Settings:
    mode: str = "chaos"  # chaos | handover
    nodes: int = 3
    clients: int = 20
    conversations: int = 200
    turn_seconds: float = 0.3
    text_chars: int = 60
    json_share: float = 0.2
    think: float = 0.1
    ttl: float = 2.0
    shards: int = 64
    grace: float = 10.0
    planted: int = 3  # conversations left with a cut turn and a postponed message per fault
    planted_seconds: float = 3.0  # how long a planted turn streams
    rounds: int = 1
    faults: tuple[str, ...] = FAULTS
    steady: float = 5.0
    tail: float = 2.0
    pause: float | None = None  # SIGSTOP length; default 2 x TTL + 1
    pg_down: float = 5.0
    deadline: float = 60.0
    head_timeout: float = 5.0
    read_timeout: float = 10.0
    limit: float = 60.0  # hang guard of each wait for the table or the log
    fsync: bool = False
    seed: int = 1
    logs: str | None = None

    @property
    def model_delay(self) -> float:
        chunks = math.ceil((_ECHO_PREFIX + self.text_chars) / _CHUNK)
        return round(self.turn_seconds / chunks, 4)


@dataclass
class Run:
    s: Settings
    nodes: Nodes
    table: Table
    load: Load
    rng: random.Random
    windows: list[dict[str, Any]] = field(default_factory=list)
    all_windows: list[Window] = field(default_factory=list)  # gaps between windows included
    joined: str | None = None  # the node that joined last
    planted: list[str] = field(default_factory=list)

    def begin(self, name: str) -> None:
        self.all_windows.append(self.load.begin(name))

    async def snapshot(self) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], int],
                                      dict[int, int]]:
        """Each up node's takeovers and fenced appends (by process), and the epochs."""
        takeovers: dict[tuple[str, int], int] = {}
        fenced: dict[tuple[str, int], int] = {}
        for node in self.nodes.running():
            view = await self.nodes.admin_view(node)
            if view is not None and node.proc is not None:
                takeovers[(node.name, node.proc.pid)] = int(view.get("takeovers", 0))
                fenced[(node.name, node.proc.pid)] = int(view.get("fenced_appends", 0))
        leases = await self.table.try_leases() or {}
        return takeovers, fenced, {s: lease.epoch for s, lease in leases.items()}

    def victim(self, exclude: set[str], leases: dict[int, Any]) -> str:
        """A live node that holds shards, drawn by the run's seed (rounds vary the victim)."""
        holding = {lease.owner for lease in leases.values() if lease.live}
        return self.rng.choice(sorted((self.nodes.live() & holding) - exclude))

    async def orphans(self) -> dict[str, int]:
        """Shards no live lease holds, or whose live owner does not serve them, for 3 TTLs."""
        deadline = time.monotonic() + 3 * self.s.ttl
        while True:
            leases = await self.table.try_leases() or {}
            views = {n.name: await self.nodes.admin_view(n) for n in self.nodes.running()}
            serving = {name: {int(s) for s in v.get("shards", {})}
                       for name, v in views.items() if v is not None}
            orphaned = sum(1 for lease in leases.values() if lease.live
                           and lease.owner in serving and lease.shard not in serving[lease.owner])
            unserved = sum(1 for lease in leases.values() if not lease.live)
            if (not orphaned and not unserved and leases) or time.monotonic() > deadline:
                return {"orphaned": orphaned, "unserved": unserved}
            await asyncio.sleep(0.2)

    async def window(self, name: str, fault: Callable[[float], Awaitable[dict[str, Any]]]
                     ) -> dict[str, Any]:
        takeovers, fenced, epochs = await self.snapshot()
        self.begin(name)
        started = time.monotonic()
        out: dict[str, Any] = {"window": name}
        out.update(await fault(started))
        out["balanced_s"] = await self.table.until("balanced", self.nodes.live(), started,
                                                   self.s.limit)
        await asyncio.sleep(self.s.tail)
        out.update(await self.orphans())
        out["crashed"] = [n.name for n in self.nodes.by_name.values()  # exited on their own
                          if n.up and n.proc is not None and n.proc.returncode is not None]
        takeovers_after, fenced_after, epochs_after = await self.snapshot()
        out["takeovers"] = sum(n - takeovers.get(k, 0) for k, n in takeovers_after.items())
        out["fenced_appends"] = sum(n - fenced.get(k, 0) for k, n in fenced_after.items())
        out["epoch_moves"] = sum(e - epochs.get(s, e) for s, e in epochs_after.items())
        out.update(self.load.window.report())
        self.begin("between")
        self.windows.append(out)
        return out

    async def plant(self, victim: str, leases: dict[int, Any]) -> int:
        """Give a few of ``victim``'s conversations a long turn and a postponed message
        (both acknowledged, 202), then leave them alone: once the fault cuts the turn, only
        the new owner can end it and run the postponed one (issue 20, item 3)."""
        mine = {s for s, lease in leases.items() if lease.live and lease.owner == victim}
        load = self.load
        cids = [c for c in load.conversations
                if shard_of(c, self.s.shards) in mine and c not in load.reserved]
        cids = cids[:self.s.planted]
        load.reserved.update(cids)
        chars = math.ceil(self.s.planted_seconds / max(self.s.model_delay, 0.001)) * _CHUNK
        rng = random.Random(self.s.seed + len(self.planted))

        async def one(cid: str) -> None:
            await load.send_once(rng, cid, f"{cid} planted {len(self.planted)} " + "x" * chars,
                                 streamed=False)
            await load.send_once(rng, cid, f"{cid} postponed {len(self.planted)}",
                                 streamed=False)

        await asyncio.gather(*(one(c) for c in cids))
        self.planted.extend(cids)
        return len(cids)

    # -- the faults: each returns its own figures; seconds count from the window's start
    async def steady(self, started: float) -> dict[str, Any]:
        await asyncio.sleep(self.s.steady)
        return {}

    async def kill9(self, started: float) -> dict[str, Any]:
        leases = await self.table.leases()
        victim = self.victim(set(), leases)
        planted = await self.plant(victim, leases)
        await self.nodes.kill(victim)
        served = await self.table.until("served", self.nodes.live(), started, self.s.limit)
        await self.nodes.start(victim)
        return {"node": victim, "shards_lost": _held(leases, victim), "planted": planted,
                "served_s": served, "restarted_s": round(time.monotonic() - started, 3)}

    async def sigstop(self, started: float) -> dict[str, Any]:
        leases = await self.table.leases()
        victim = self.victim(set(), leases)
        planted = await self.plant(victim, leases)
        self.nodes.pause(victim)
        try:
            served = await self.table.until("served", self.nodes.live(), started, self.s.limit)
            pause = self.s.pause if self.s.pause is not None else 2 * self.s.ttl + 1
            await asyncio.sleep(max(0.0, started + pause - time.monotonic()))
        finally:
            self.nodes.resume(victim)
        return {"node": victim, "shards_lost": _held(leases, victim), "planted": planted,
                "served_s": served, "resumed_s": round(time.monotonic() - started, 3)}

    async def join(self, started: float) -> dict[str, Any]:
        name = next(f"n{i}" for i in range(1, 99)
                    if self.nodes.by_name.get(f"n{i}") is None
                    or self.nodes.by_name[f"n{i}"].state in ("left", "killed"))
        watch = asyncio.ensure_future(self.table.first_shard(name, started, self.s.limit))
        await self.nodes.start(name)
        self.load.targets.append(name)
        self.joined = name
        return {"node": name, "listening_s": round(time.monotonic() - started, 3),
                **await watch}

    async def leave(self, started: float) -> dict[str, Any]:
        leases = await self.table.leases()
        victim = self.victim({self.joined} if self.joined else set(), leases)
        self.load.targets.remove(victim)  # drained from the balancer first
        live = self.nodes.live() - {victim}
        exited, served = await asyncio.gather(
            self.nodes.leave(victim),
            self.table.until("served", live, started, self.s.limit))
        return {"node": victim, "shards_moved": _held(leases, victim), "served_s": served,
                "exited_s": round(exited, 3)}

    async def pgstop(self, started: float) -> dict[str, Any]:
        await self.nodes.pg_stop()
        await asyncio.sleep(self.s.pg_down)
        await self.nodes.pg_start()
        back = time.monotonic() - started
        served = await self.table.until("served", self.nodes.live(), started, self.s.limit)
        return {"pg_back_s": round(back, 3), "served_s": served}

    async def pgrestart(self, started: float) -> dict[str, Any]:
        await self.nodes.pg_restart()
        back = time.monotonic() - started
        served = await self.table.until("served", self.nodes.live(), started, self.s.limit)
        return {"pg_back_s": round(back, 3), "served_s": served}


def _logs_dir(path: str | None) -> Path:
    logs = Path(path or tempfile.mkdtemp(prefix="torpor-chaos-"))
    logs.mkdir(parents=True, exist_ok=True)
    return logs


def _held(leases: dict[int, Any], name: str) -> int:
    return sum(1 for lease in leases.values() if lease.live and lease.owner == name)


async def run(s: Settings) -> dict[str, Any]:
    """One run: the cluster, the load, the schedule, the checks; its figures."""
    began = time.monotonic()
    logs = _logs_dir(s.logs)
    with running_cluster(fsync=s.fsync) as pg:
        db = pg.url()
        async with PostgresStore(db):  # the schema first, so the nodes do not race on it
            pass
        nodes = Nodes(pg, db, logs, ttl=s.ttl, shards=s.shards, model_delay=s.model_delay,
                      grace=s.grace, fsync=s.fsync)
        table = Table(db, s.shards)
        conversations = [f"c{i}" for i in range(s.conversations)]
        load = Load(nodes, clients=s.clients, conversations=conversations,
                    text_chars=s.text_chars, json_share=s.json_share, think=s.think,
                    deadline=s.deadline, head_timeout=s.head_timeout,
                    read_timeout=s.read_timeout, seed=s.seed)
        r = Run(s, nodes, table, load, random.Random(s.seed))
        out: dict[str, Any] = {"benchmark": "cluster_chaos", "mode": s.mode,
                               "config": {**asdict(s), "model_delay": s.model_delay,
                                          "logs": str(logs)}}
        try:
            names = [f"n{i + 1}" for i in range(s.nodes)]
            await asyncio.gather(*(nodes.start(n) for n in names))
            load.targets = list(names)
            out["initial_balanced_s"] = await table.until("balanced", nodes.live(),
                                                          time.monotonic(), s.limit)
            load.start()
            await r.window("steady", r.steady)
            schedule = s.faults if s.mode == "chaos" else ("join", "leave")
            for _ in range(s.rounds):
                for fault in schedule:
                    await r.window(fault, getattr(r, fault))
            r.begin("stopping")
            await load.stop()
            r.begin("final")
            out["quiet"] = await quiet_end(r)
            out["final_round"] = await final_round(r)
            r.begin("end")
            out["node_logs"] = nodes.log_errors()
        finally:
            await load.stop()
            await nodes.close()
            await table.close()
        out["windows"] = r.windows
        out["totals"] = totals(r)
        out["check"] = await check(db, load.acked, s.shards)
    out["seconds"] = round(time.monotonic() - began, 1)
    return out


async def quiet_end(r: Run) -> dict[str, Any]:
    """With no request, every shard balanced and then every turn ended (work re-driven)."""
    started = time.monotonic()
    balanced = await r.table.until("balanced", r.nodes.live(), started, r.s.limit)
    deadline = time.monotonic() + r.s.limit
    while True:
        open_turns = await unended(r.nodes.db)
        if not open_turns or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.25)
    return {"balanced_s": balanced,
            "every_turn_ended_s": None if open_turns else round(time.monotonic() - started, 3),
            "unended_turns": sum(map(len, open_turns.values())),
            "unended_conversations": len(open_turns),
            "planted": len(r.planted),
            "planted_unended": sum(1 for c in r.planted if c in open_turns),
            "examples": dict(list(open_turns.items())[:5])}


async def final_round(r: Run) -> dict[str, Any]:
    """Every conversation answers once more, through a random node."""
    gate = asyncio.Semaphore(r.s.clients)
    rng = random.Random(r.s.seed + 7)

    async def one(cid: str) -> None:
        async with gate:
            await r.load.send_once(rng, cid, f"{cid} final")

    await asyncio.gather(*(one(c) for c in r.load.conversations))
    w = r.load.window
    return {"conversations": len(r.load.conversations), "answered": w.answered,
            "aborted": w.aborted, "gave_up": w.gave_up, "failed": w.failed,
            "errors": dict(w.errors)}


def totals(r: Run) -> dict[str, Any]:
    every = [*r.all_windows, r.load.window]
    errors: Counter[str] = Counter()
    for w in every:
        errors.update(w.errors)
    return {
        "requests": sum(w.requests for w in every),
        "errors": sum(errors.values()),
        "status_500": sum(n for k, n in errors.items() if " 500" in k),
        "errors_by_kind": dict(errors.most_common()),
        "acknowledged": len(r.load.acked),
        "sent_unacknowledged": len(set(r.load.tried) - set(r.load.acked)),
        "gave_up": sum(w.gave_up for w in every),
        "failed": sum(w.failed for w in every),
        "proxied": sum(w.proxied for w in every),
    }


def settings(args: argparse.Namespace) -> Settings:
    s = Settings(mode=args.mode)
    if args.mode == "handover":
        s.clients, s.turn_seconds, s.text_chars, s.json_share = 60, 5.0, 90, 0.1
        s.think, s.steady, s.tail, s.rounds = 0.2, 10.0, 5.0, 3
    if args.quick:
        s.clients, s.conversations, s.steady, s.tail, s.limit = 8, 60, 2.0, 1.0, 30.0
        if args.mode == "handover":
            s.clients, s.conversations, s.steady, s.tail, s.rounds = 16, 60, 5.0, 3.0, 1
    for name in ("clients", "conversations", "turn_seconds", "ttl", "shards", "rounds",
                 "steady", "tail", "pause", "pg_down", "grace", "think", "seed", "logs",
                 "json_share", "limit", "planted"):
        value = getattr(args, name)
        if value is not None:
            setattr(s, name, value)
    if args.faults:
        s.faults = tuple(args.faults)
    s.fsync = not args.no_fsync
    return s


def tables(data: dict[str, Any]) -> list[Any]:
    rows = [(w["window"], w.get("node", ""), w["requests"], w["errors"], w["status_500"],
             w["errors_at_down_nodes"], w["acknowledged"], w["send_max_s"], w.get("served_s"),
             w["balanced_s"], w["takeovers"], w["epoch_moves"], w["orphaned"])
            for w in data["windows"]]
    c, q = data["check"], data["quiet"]
    moves = [(w["window"], w["node"], w["requests"], w["errors"], w["error_rate"], w["sends"],
              w["sends_with_errors"], w["send_error_rate"],
              w.get("first_shard_after_registering_s"), w.get("served_s"), w["balanced_s"])
             for w in data["windows"] if w["window"] in ("join", "leave")]
    return [
        table(f"fault windows ({data['mode']}, TTL {data['config']['ttl']:g} s, "
              f"{data['config']['clients']} clients; served, bal.: seconds from the window's "
              "start; max: slowest send, first try to its end)",
              ["window", "node", "req", "err", "500", "down", "acked", "max", "served", "bal.",
               "taken", "epochs", "orphan"], rows),
        table("joins and leaves: what clients saw (rates: failed requests / requests, "
              "sends that met an error / sends)",
              ["window", "node", "req", "err", "rate", "sends", "erred", "rate",
               "1st shard s", "served s", "balanced s"], moves),
        table("the log in PostgreSQL, after the run",
              ["acked", "lost", "dup", "not dense", "epoch back", "parked",
               "unended (quiet)", "planted unended", "unended (end)"],
              [(c["acknowledged"], c["lost"], c["duplicated"], c["not_dense"],
                c["epoch_regressions"], c["parked"], q["unended_turns"],
                q["planted_unended"], c["unended_turns"])]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["chaos", "handover"], default="chaos")
    parser.add_argument("--quick", action="store_true", help="a small run")
    parser.add_argument("--clients", type=int)
    parser.add_argument("--conversations", type=int)
    parser.add_argument("--turn-seconds", type=float, help="how long a turn streams")
    parser.add_argument("--ttl", type=float, help="the nodes' lease TTL (default 2)")
    parser.add_argument("--shards", type=int)
    parser.add_argument("--rounds", type=int, help="times the schedule runs")
    parser.add_argument("--faults", nargs="+", choices=FAULTS, help="the schedule's windows")
    parser.add_argument("--steady", type=float, help="seconds of load before the faults")
    parser.add_argument("--tail", type=float, help="seconds each window runs on, balanced")
    parser.add_argument("--pause", type=float, help="SIGSTOP seconds (default 2 TTL + 1)")
    parser.add_argument("--pg-down", type=float, help="seconds PostgreSQL stays stopped")
    parser.add_argument("--grace", type=float, help="the nodes' --shutdown-grace")
    parser.add_argument("--think", type=float, help="a client's pause between sends")
    parser.add_argument("--json-share", type=float, help="share of fire-and-forget sends")
    parser.add_argument("--limit", type=float, help="hang guard of each wait, seconds")
    parser.add_argument("--planted", type=int, help="conversations planted per kill/stop")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--logs", help="where the nodes' logs go (default: a temp dir)")
    parser.add_argument("--no-fsync", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    quiet()
    s = settings(args)
    data = asyncio.run(run(s))
    data["targets"] = {"join_leave_error_rate_max": 0.001,
                       "first_shard_after_registering_max_s": min(1.0, s.ttl / 4),
                       "status_500": 0, "takeovers_after_pg_restart_max": 10}
    emit(data, tables(data), args.json)


if __name__ == "__main__":
    main()
