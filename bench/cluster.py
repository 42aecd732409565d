"""Several torpor nodes on one PostgreSQL (issue 12): throughput, the fence's cost, takeover.

Three measurements, each against one throwaway PostgreSQL (``tests/pg_cluster.py``):

* ``nodes``: turns/s and send latency (request to the turn's answer, over SSE)
  through ``torpor serve`` processes (EchoModel, no delay): 1 node; 3 nodes with
  every request sent to a random node (two in three are proxied to the owner);
  3 nodes with every request sent to its owner. All on one machine, so the
  figure to read is the ratio to 1 node, not the absolute.
* ``fence``: the PostgreSQL store appending with a node's fence (every batch
  reads its shards' lease rows ``FOR SHARE`` and checks the epoch) and without,
  interleaved rounds in the same run; appends/s and per-append latency.
* ``takeover``: 3 nodes, ``kill -9`` of the one owning the most shards; seconds
  from the kill until each of a sample of its conversations answers again
  (through a surviving node), and until the lease table shows its shards held.

Usage: ``python bench/cluster.py [--quick] [--clients 24] [--seconds 8]
[--ttl 2] [--no-fsync] [--json FILE]``. ``--quick`` runs in under a minute.
Prints tables and one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from _common import ROOT, emit, quiet, ratio, table

sys.path.insert(0, str(ROOT / "tests"))
import asyncpg
from pg_cluster import running_cluster

from torpor.cluster import desired_owner, shard_of, sql
from torpor.events import UserMessage
from torpor.serve.client import Client
from torpor.store.postgres import PostgresStore

TOKEN = "bench-token"
ADMIN = "bench-admin"
SHARDS = 64


def _ms(samples: Sequence[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)


async def fresh_schema(server: str) -> str:
    schema = "b_" + uuid.uuid4().hex[:12]
    async with asyncpg.create_pool(server, min_size=1, max_size=1) as pool:
        await pool.execute(f"CREATE SCHEMA {schema}")
    url = f"{server}?search_path={schema}"
    async with PostgresStore(url):  # the schema first, so the nodes do not race on it
        pass
    return url


class Node:
    def __init__(self, name: str, proc: asyncio.subprocess.Process, url: str) -> None:
        self.name = name
        self.proc = proc
        self.url = url
        self.client = Client(url, TOKEN)


async def start_node(name: str, db: str, ttl: float) -> Node:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "torpor", "serve", "--db", db, "--port", "0", "--model", "echo",
        "--node-id", name, "--lease-ttl", str(ttl), "--shards", str(SHARDS), "--token", TOKEN,
        "--admin-token", ADMIN, "--log-level", "error", "--shutdown-grace", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, cwd=ROOT,
    )
    assert proc.stdout is not None
    async with asyncio.timeout(60):
        while True:
            line = (await proc.stdout.readline()).decode()
            if not line:
                raise RuntimeError(f"node {name} exited before listening")
            if line.startswith("torpor serve: listening on "):
                return Node(name, proc, line.split()[4].rstrip("/"))


@asynccontextmanager
async def cluster(db: str, count: int, ttl: float) -> AsyncIterator[list[Node]]:
    nodes: list[Node] = []
    try:
        for i in range(count):
            nodes.append(await start_node(f"n{i + 1}", db, ttl))
        await settled(db, {n.name for n in nodes})
        yield nodes
    finally:
        for n in nodes:
            if n.proc.returncode is None:
                n.proc.send_signal(signal.SIGTERM)
        for n in nodes:
            await n.proc.wait()


async def lease_owners(db: str) -> dict[int, str | None]:
    conn = await asyncpg.connect(db)
    try:
        rows = await conn.fetch(sql.LEASES)  # live while the owner's node row is
    finally:
        await conn.close()
    return {r[0]: r[1] if r[5] else None for r in rows}


async def settled(db: str, live: set[str]) -> float:
    """Seconds until every shard is held by the node in ``live`` rendezvous hashing gives it
    (so no hand-off is still under way)."""
    started = time.monotonic()
    async with asyncio.timeout(60):
        while True:
            owners = await lease_owners(db)
            if len(owners) == SHARDS and all(
                owner == desired_owner(shard, live) for shard, owner in owners.items()
            ):
                return time.monotonic() - started
            await asyncio.sleep(0.02)


async def one_turn(node: Node, cid: str, text: str) -> bool:
    """Send and read the turn's stream to its answer; False when it did not answer."""
    conn, response = await node.client.open(
        "POST", f"/v1/conversations/{cid}/messages", json_body={"text": text},
        headers={"Accept": "text/event-stream"})
    try:
        if response.status != 200:
            await response.read()
            return False
        async for event in response.events():
            if event.event == "assistant":
                return True
        return False
    finally:
        await conn.close()


async def drive(nodes: list[Node], db: str, clients: int, seconds: float,
                route: str) -> dict[str, Any]:
    """``clients`` loops of turns for ``seconds``: to a random node, or to the owner."""
    owners = await lease_owners(db)
    by_name = {n.name: n for n in nodes}
    latencies: list[float] = []
    failed = 0
    deadline = time.monotonic() + seconds

    async def client(c: int) -> None:
        nonlocal failed
        rng = random.Random(c)
        cids = [f"{route}-{c}-{k}" for k in range(4)]
        turn = 0
        while time.monotonic() < deadline:
            cid = cids[turn % len(cids)]
            if route == "owner":
                node = by_name[owners[shard_of(cid, SHARDS)] or nodes[0].name]
            else:
                node = rng.choice(nodes)
            started = time.perf_counter()
            if await one_turn(node, cid, f"turn {turn} of client {c}"):
                latencies.append(time.perf_counter() - started)
            else:
                failed += 1
            turn += 1

    started = time.monotonic()
    await asyncio.gather(*(client(c) for c in range(clients)))
    elapsed = time.monotonic() - started
    return {
        "turns": len(latencies), "failed": failed,
        "turns_per_second": round(len(latencies) / elapsed, 1),
        "send_p50_ms": _ms(latencies, 0.5), "send_p99_ms": _ms(latencies, 0.99),
    }


async def bench_nodes(server: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    db = await fresh_schema(server)
    async with cluster(db, 1, args.ttl) as nodes:
        out["one_node"] = await drive(nodes, db, args.clients, args.seconds, "any")
    db = await fresh_schema(server)
    async with cluster(db, 3, args.ttl) as nodes:
        out["three_nodes_any"] = await drive(nodes, db, args.clients, args.seconds, "any")
        out["three_nodes_owner"] = await drive(nodes, db, args.clients, args.seconds, "owner")
    one = out["one_node"]["turns_per_second"]
    out["ratio_three_any_to_one"] = ratio(out["three_nodes_any"]["turns_per_second"], one)
    out["ratio_three_owner_to_one"] = ratio(out["three_nodes_owner"]["turns_per_second"], one)
    return out


class AllShards:
    """A node's fence holding every shard at epoch 1 (what a lone node's store presents)."""

    idle_timeout = 5.0

    def hold(self, conversation_id: str) -> tuple[int, int]:
        return shard_of(conversation_id, SHARDS), 1

    def fenced(self, shard: int, epoch: int) -> None:
        raise AssertionError("the benchmark's lease rows never move")


async def bench_fence(server: str, args: argparse.Namespace) -> dict[str, Any]:
    """Appends with and without the fence, interleaved rounds in one run."""
    db = await fresh_schema(server)
    conn = await asyncpg.connect(db)
    try:
        await conn.execute(
            "INSERT INTO shard_leases (shard, owner, owner_incarnation, epoch, lease_until) "
            "SELECT g, 'bench', 1, 1, now() + interval '1 day' FROM generate_series(0, $1 - 1) g",
            SHARDS)
    finally:
        await conn.close()
    results: dict[str, dict[str, list[float]]] = {
        "fenced": {"rate": [], "lat": []}, "unfenced": {"rate": [], "lat": []}}
    for round_no in range(args.fence_rounds):
        for name in ("unfenced", "fenced") if round_no % 2 else ("fenced", "unfenced"):
            fence = AllShards() if name == "fenced" else None
            async with PostgresStore(db, fence=fence) as store:
                cids = [f"{name}-{c}" for c in range(args.fence_conversations)]
                lat: list[float] = []

                async def appender(cid: str, lat: list[float] = lat) -> None:
                    for _ in range(args.fence_appends):
                        started = time.perf_counter()
                        await store.append(cid, [UserMessage("x" * 40)])
                        lat.append(time.perf_counter() - started)

                started = time.perf_counter()
                await asyncio.gather(*(appender(c) for c in cids))
                elapsed = time.perf_counter() - started
            results[name]["rate"].append(len(lat) / elapsed)
            results[name]["lat"].extend(lat)
    out: dict[str, Any] = {"rounds": args.fence_rounds,
                           "conversations": args.fence_conversations,
                           "appends_per_conversation_per_round": args.fence_appends}
    for name, r in results.items():
        out[name] = {"appends_per_second": round(statistics.median(r["rate"]), 1),
                     "append_p50_ms": _ms(r["lat"], 0.5), "append_p99_ms": _ms(r["lat"], 0.99)}
    out["throughput_ratio_fenced_to_unfenced"] = ratio(
        out["fenced"]["appends_per_second"], out["unfenced"]["appends_per_second"])
    p50f, p50u = out["fenced"]["append_p50_ms"], out["unfenced"]["append_p50_ms"]
    out["added_p50_ms_per_append"] = round(p50f - p50u, 3) if p50f and p50u else None
    return out


async def bench_takeover(server: str, args: argparse.Namespace) -> dict[str, Any]:
    db = await fresh_schema(server)
    async with cluster(db, 3, args.ttl) as nodes:
        owners = await lease_owners(db)
        counts: dict[str, int] = {}
        for owner in owners.values():
            if owner is not None:
                counts[owner] = counts.get(owner, 0) + 1
        victim = next(n for n in nodes if n.name == max(counts, key=lambda k: counts[k]))
        survivors = [n for n in nodes if n is not victim]
        lost = {s for s, o in owners.items() if o == victim.name}
        cids: list[str] = []
        k = 0
        while len(cids) < args.takeover_sample:
            cid = f"t{k}"
            if shard_of(cid, SHARDS) in lost:
                cids.append(cid)
            k += 1
        for cid in cids:  # live on the victim before it dies
            assert await one_turn(victim, cid, "before")
        victim.proc.kill()
        killed = time.monotonic()
        answered: list[float] = []

        async def until_answered(i: int, cid: str) -> None:
            attempt = 0
            while True:
                node = survivors[(i + attempt) % len(survivors)]
                try:
                    if await one_turn(node, cid, f"after {attempt}"):
                        answered.append(time.monotonic() - killed)
                        return
                except (OSError, ValueError, asyncio.IncompleteReadError):
                    pass
                attempt += 1
                await asyncio.sleep(0.05)  # the client's retry interval

        async with asyncio.timeout(60):
            leases_task = asyncio.ensure_future(settled(db, {n.name for n in survivors}))
            await asyncio.gather(*(until_answered(i, c) for i, c in enumerate(cids)))
            await leases_task
        held = time.monotonic() - killed
    return {
        "lease_ttl_seconds": args.ttl, "shards_of_the_dead_node": len(lost),
        "conversations_sampled": len(cids),
        "first_answer_seconds": round(min(answered), 3),
        "answer_p50_seconds": round(statistics.median(answered), 3),
        "answer_max_seconds": round(max(answered), 3),
        "all_shards_held_seconds": round(held, 3),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with running_cluster(fsync=not args.no_fsync) as pg:
        server = pg.url()
        nodes = await bench_nodes(server, args)
        fence = await bench_fence(server, args)
        takeover = await bench_takeover(server, args)
    return {
        "benchmark": "cluster",
        "config": {"clients": args.clients, "seconds_per_run": args.seconds,
                   "lease_ttl": args.ttl, "shards": SHARDS, "fsync": not args.no_fsync,
                   "model": "EchoModel (delay 0)", "quick": args.quick,
                   "nodes": "torpor serve --node-id subprocesses on one machine"},
        "nodes": nodes, "fence": fence, "takeover": takeover,
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small runs, under a minute")
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--seconds", type=float, default=8.0, help="per throughput run")
    parser.add_argument("--ttl", type=float, default=2.0, help="the nodes' lease TTL")
    parser.add_argument("--fence-rounds", type=int, default=8)
    parser.add_argument("--fence-conversations", type=int, default=200)
    parser.add_argument("--fence-appends", type=int, default=40)
    parser.add_argument("--takeover-sample", type=int, default=20)
    parser.add_argument("--no-fsync", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.seconds, args.fence_rounds = 12, 3.0, 4
        args.fence_conversations, args.fence_appends, args.takeover_sample = 100, 5, 8
    quiet()
    data = asyncio.run(main(args))
    n, f, t = data["nodes"], data["fence"], data["takeover"]
    tables = [
        table(f"{args.clients} clients, {args.seconds:g} s each, one PostgreSQL, one machine",
              ["route", "turns/s", "vs 1 node", "send p50 ms", "p99", "failed"],
              [(name, r["turns_per_second"], ratio(r["turns_per_second"],
                                                   n["one_node"]["turns_per_second"]),
                r["send_p50_ms"], r["send_p99_ms"], r["failed"])
               for name, r in (("1 node", n["one_node"]),
                               ("3 nodes, any node (proxied)", n["three_nodes_any"]),
                               ("3 nodes, to the owner", n["three_nodes_owner"]))]),
        table("the fence check per append (same run, interleaved)",
              ["store", "appends/s", "p50 ms", "p99 ms"],
              [(name, f[name]["appends_per_second"], f[name]["append_p50_ms"],
                f[name]["append_p99_ms"]) for name in ("unfenced", "fenced")]),
        table(f"takeover after kill -9 (lease TTL {t['lease_ttl_seconds']:g} s)",
              ["shards lost", "first answer s", "p50 s", "max s", "all shards held s"],
              [(t["shards_of_the_dead_node"], t["first_answer_seconds"],
                t["answer_p50_seconds"], t["answer_max_seconds"],
                t["all_shards_held_seconds"])]),
    ]
    emit(data, tables, args.json)


if __name__ == "__main__":
    cli()
