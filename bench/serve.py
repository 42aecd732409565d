"""The cost of HTTP: `torpor serve` against a minimal app doing the same durable work.

Questions: what does a chat turn over HTTP (JSON in, Server-Sent Events out) cost
``torpor serve``, against the least app that does the same durable work, in the same
run on the same machine? What does an idle follower cost the server? Ratios are what
to read: the machine is shared, and the output says how loaded it was.

The floor is a **minimal app** (bench/_serve_minimal.py): Starlette + uvicorn, the
user message and the answer each committed with aiosqlite (WAL, synchronous=NORMAL),
the echo streamed back over SSE with sse-starlette. Both servers are separate
processes started by bench/_serve_launch.py on the same kind of socket with the same
uvicorn settings, and both get the same client load (bench/_serve_client.py, raw
asyncio streams, so the client takes as little of the two cores as it can). For each
event loop + HTTP parser (**asyncio + h11**; **uvloop + httptools** when both import):

1. **turns**: ``--clients`` (32 and 256) kept-alive connections, each on its own
   conversation, post a message and read its SSE stream to the end, again and again,
   for ``--seconds``: turns/s, server CPU per turn (utime + stime of the server process
   from /proc over the window), first-delta latency p50/p99 (POST sent to the first
   ``event: delta``), and the client's own CPU per turn.
2. **keep-alive**: one connection, ``GET /healthz`` back to back (p50), and one client's
   SSE turn (p50), with the listening socket as ``torpor.serve.bind`` makes it
   (*shipped*) and with TCP_NODELAY set (*on*), both apps.
3. **followers**: a fresh server per app; ``--followers`` (1,000 then 10,000) open SSE
   GETs of as many conversations' streams; server RSS growth over the count is the
   memory per idle follower. Then one message is posted to every conversation and every
   follower must receive its next event (counted, and how long the fan-out took).

``torpor serve`` runs ``--model echo`` at its default log level (info, as deployed;
stderr to /dev/null). The turn and follower points use ``--nodelay`` (default *on*,
the same for both apps: a CPU comparison, not a Nagle one; *shipped* measures the
socket as torpor makes it). A reference row runs the same turns in-process
(``Runtime.send``) at the first client count. Figures, never assertions.

``--apps minimal lean`` adds (or sets against each other) **lean**: the minimal app with a
bare ASGI SSE response instead of sse-starlette's (no per-stream task group), what a
leaner response would save. uvloop and httptools are optional: a variant whose modules
do not import is skipped and the output says so. A full run took 2.5 minutes on two
shared cores; ``--quick`` runs smaller sizes. ``bench/serve_profile.py`` says where the CPU goes.

Usage: ``python bench/serve.py [--quick] [--clients 32 256] [--seconds 4]
[--followers 1000 10000] [--variants asyncio+h11 uvloop+httptools] [--apps torpor minimal]
[--nodelay on|shipped] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import ROOT, emit, fresh_db, quiet, ratio, table
from _serve_client import Conn, TurnTimes, open_conn

import torpor
from torpor.runtime.stats import percentile

TOKEN = "bench-" + secrets.token_hex(8)
ADMIN = "bench-admin-" + secrets.token_hex(8)
APPS = ("torpor", "minimal")  # the comparison; "lean" (minimal app, bare SSE) on request
VARIANTS = {"asyncio+h11": ("asyncio", "h11"), "uvloop+httptools": ("uvloop", "httptools")}
TICK = os.sysconf("SC_CLK_TCK")
LAUNCH = ROOT / "bench" / "_serve_launch.py"


def _ms(samples: list[float], q: float) -> float | None:
    value = percentile(samples, q)
    return None if value is None else round(value * 1000, 3)


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used, all its threads."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15)


def proc_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def machine_busy() -> tuple[float, float]:
    """(busy CPU seconds, wall seconds) of the whole machine so far, from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as stat:
        values = [int(x) for x in stat.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / TICK, time.monotonic()


@dataclass
class Server:
    """One server process started by bench/_serve_launch.py."""

    app: str
    process: subprocess.Popen[str]
    host: str
    port: int

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(app: str, directory: Path, *, loop: str, http: str, nodelay: str,
                 extra: list[str] | None = None) -> Server:
    db = directory / f"{app}-{loop}-{http}-{nodelay}-{secrets.token_hex(3)}.db"
    fresh_db(directory, db.name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    process = subprocess.Popen(
        [sys.executable, str(LAUNCH), app, "--db", str(db), "--token", TOKEN,
         "--admin-token", ADMIN, "--loop", loop, "--http", http, "--nodelay", nodelay,
         *(extra or [])],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT,
    )
    assert process.stdout is not None
    first = process.stdout.readline()
    if "listening on " not in first:
        process.kill()
        raise RuntimeError(f"{app} did not start: {first!r}")
    address = first.split("listening on http://", 1)[1].split("/", 1)[0]
    host, _, port = address.rpartition(":")
    return Server(app, process, host.strip("[]"), int(port))


async def _connect(server: Server, count: int) -> list[Conn]:
    conns: list[Conn] = []
    for start in range(0, count, 200):  # a few hundred at a time: no accept-queue overflow
        conns += await asyncio.gather(*(open_conn(server.host, server.port, TOKEN)
                                        for _ in range(start, min(count, start + 200))))
    return conns


def _body(text: str) -> bytes:
    return b'{"text": "' + text.encode() + b'"}'


async def _measured(server_pid: int | None, work: Callable[[], Awaitable[int]]
                    ) -> dict[str, Any]:
    """Run ``work`` (returns turns done); CPU of server and client, machine load, wall."""
    busy0, wall0 = machine_busy()
    server0 = proc_cpu(server_pid) if server_pid else 0.0
    client0 = time.process_time()
    started = time.perf_counter()
    turns = await work()
    seconds = time.perf_counter() - started
    client = time.process_time() - client0
    server = proc_cpu(server_pid) - server0 if server_pid else 0.0
    busy1, wall1 = machine_busy()
    machine_cores = (busy1 - busy0) / max(wall1 - wall0, 1e-9)
    ours = (server + client) / seconds
    return {
        "turns": turns, "seconds": round(seconds, 3),
        "turns_per_second": round(turns / seconds, 1) if seconds > 0 else None,
        "server_cpu_us_per_turn": round(server / turns * 1e6) if turns and server_pid else None,
        "client_cpu_us_per_turn": round(client / turns * 1e6) if turns else None,
        "server_cores": round(server / seconds, 2) if server_pid else None,
        "machine_busy_cores": round(machine_cores, 2),
        "others_busy_cores": round(max(machine_cores - ours, 0.0), 2),
    }


async def turn_load(server: Server, clients: int, seconds: float, tag: str) -> dict[str, Any]:
    """``clients`` connections, each taking turns on its own conversation for ``seconds``."""
    conns = await _connect(server, clients)
    paths = [f"/v1/conversations/{tag}-{c}/messages" for c in range(clients)]
    await asyncio.gather(*(conn.turn(paths[c], _body("hello"), None)  # activation, untimed
                           for c, conn in enumerate(conns)))
    times = TurnTimes()

    async def work() -> int:
        deadline = time.perf_counter() + seconds

        async def client(c: int) -> int:
            done = 0
            while time.perf_counter() < deadline:
                done += await conns[c].turn(paths[c], _body(f"turn {done}: anything new?"),
                                            times)
            return done

        return sum(await asyncio.gather(*(client(c) for c in range(clients))))

    result = await _measured(server.pid, work)
    for conn in conns:
        await conn.close()
    return {"clients": clients, **result, "failed": times.failed,
            "first_delta_p50_ms": _ms(times.first_delta, 50),
            "first_delta_p99_ms": _ms(times.first_delta, 99),
            "turn_p50_ms": _ms(times.turn, 50), "turn_p99_ms": _ms(times.turn, 99)}


async def keepalive(server: Server, seconds: float, requests: int, tag: str) -> dict[str, Any]:
    """One kept-alive connection: GET /healthz back to back; then one client's SSE turns."""
    (conn,) = await _connect(server, 1)
    await conn.get("/healthz")
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(samples) < requests and time.perf_counter() < deadline:
        started = time.perf_counter()
        status, _ = await conn.get("/healthz")
        samples.append(time.perf_counter() - started)
        assert status == 200, status
    path = f"/v1/conversations/{tag}/messages"
    await conn.turn(path, _body("hello"), None)
    times = TurnTimes()
    deadline = time.perf_counter() + seconds
    while len(times.turn) < requests // 4 and time.perf_counter() < deadline:
        await conn.turn(path, _body("one more?"), times)
    await conn.close()
    return {"healthz_requests": len(samples), "healthz_p50_ms": _ms(samples, 50),
            "healthz_p99_ms": _ms(samples, 99), "sse_turns": len(times.turn),
            "sse_turn_p50_ms": _ms(times.turn, 50),
            "sse_first_delta_p50_ms": _ms(times.first_delta, 50)}


async def followers(server: Server, counts: list[int], tag: str) -> dict[str, Any]:
    """Open idle followers up to each count (RSS growth per follower); then every one of
    them must receive the next event of its conversation."""
    warm = await _connect(server, 20)  # one-off allocations out of the baseline
    await asyncio.gather(*(c.follow(f"/v1/conversations/{tag}-warm-{i}/stream")
                           for i, c in enumerate(warm)))
    for c in warm:
        c.abort()
    await asyncio.sleep(1.0)  # a figure, not a test: let the server see the aborts
    before = proc_rss(server.pid)
    conns: list[Conn] = []
    points = []
    for count in counts:
        fresh = await _connect(server, count - len(conns))
        base = len(conns)
        statuses = await asyncio.gather(*(
            c.follow(f"/v1/conversations/{tag}-{base + i}/stream")
            for i, c in enumerate(fresh)))
        conns += fresh
        refused = sum(1 for s in statuses if s != 200)
        after = proc_rss(server.pid)
        points.append({"followers": count, "refused": refused, "rss_before_bytes": before,
                       "rss_after_bytes": after,
                       "bytes_per_follower": round((after - before) / count)})
    # every follower gets the next event: one message posted to each conversation
    waiting = [asyncio.ensure_future(c.next_event()) for c in conns]
    posters = await _connect(server, 32)
    started = time.perf_counter()

    async def post(p: int) -> None:
        for i in range(p, len(conns), len(posters)):
            status, _ = await posters[p].post_json(f"/v1/conversations/{tag}-{i}/messages",
                                                   _body("wake up"))
            assert status in (200, 202), status

    await asyncio.gather(*(post(p) for p in range(len(posters))))
    posted = time.perf_counter() - started
    done, pending = await asyncio.wait(waiting, timeout=max(30.0, len(conns) / 50))
    received = sum(1 for t in done if t.exception() is None and b"event:" in t.result())
    fanout = time.perf_counter() - started
    for t in pending:
        t.cancel()
    for c in [*conns, *posters]:
        c.abort()
    return {"points": points, "received_next_event": received, "followers": len(conns),
            "post_seconds": round(posted, 2), "fanout_seconds": round(fanout, 2)}


async def in_process(url: str, clients: int, seconds: float) -> dict[str, Any]:
    """The same turns through ``Runtime.send`` in this process (the first delta, the turn)."""
    times = TurnTimes()
    async with torpor.Runtime(url, model=torpor.EchoModel()) as rt:
        for c in range(clients):  # activation, not timed (as over HTTP)
            await (await rt.send(f"p-{c}", "hello")).result()

        async def work() -> int:
            deadline = time.perf_counter() + seconds

            async def client(c: int) -> int:
                done = 0
                while time.perf_counter() < deadline:
                    started = time.perf_counter()
                    turn = await rt.send(f"p-{c}", f"turn {done}: anything new?")
                    first = None
                    async for item in turn:
                        if first is None and isinstance(item, torpor.TextDelta):
                            first = time.perf_counter() - started
                    if first is not None:
                        times.first_delta.append(first)
                    times.turn.append(time.perf_counter() - started)
                    done += 1
                return done

            return sum(await asyncio.gather(*(client(c) for c in range(clients))))

        result = await _measured(None, work)
    return {"clients": clients, **result, "first_delta_p50_ms": _ms(times.first_delta, 50),
            "first_delta_p99_ms": _ms(times.first_delta, 99),
            "turn_p50_ms": _ms(times.turn, 50), "turn_p99_ms": _ms(times.turn, 99)}


def available_variants(wanted: list[str]) -> tuple[list[str], dict[str, str]]:
    usable, missing = [], {}
    for name in wanted:
        lacking = [m for m in ("uvloop", "httptools") if m in name
                   and importlib.util.find_spec(m) is None]
        if lacking:
            missing[name] = (f"not installed here ({', '.join(lacking)}): both are on PyPI, "
                             "pip install uvloop httptools")
        else:
            usable.append(name)
    return usable, missing


async def run_variant(name: str, args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    loop, http = VARIANTS[name]
    kinds = sorted({args.nodelay, "shipped", "on"})
    apps = args.apps
    servers = {(app, nd): start_server(app, directory, loop=loop, http=http, nodelay=nd)
               for app in apps for nd in kinds}
    out: dict[str, Any] = {"loop": loop, "http": http, "turns": [], "keepalive": {}}
    try:
        for i, clients in enumerate(args.clients):
            order = apps if i % 2 == 0 else apps[::-1]  # ABBA: drift hits both sides alike
            point: dict[str, Any] = {"clients": clients}
            for app in order:
                point[app] = await turn_load(servers[(app, args.nodelay)], clients,
                                             args.seconds, f"t{clients}")
            if "torpor" in point and "minimal" in point:
                point["ratios"] = _ratios(point["torpor"], point["minimal"])
            out["turns"].append(point)
        for nd in kinds:
            out["keepalive"][nd] = {app: await keepalive(servers[(app, nd)], args.ka_seconds,
                                                         args.ka_requests, "ka")
                                    for app in apps}
    finally:
        for server in servers.values():
            server.stop()
    if args.followers:
        out["followers"] = {}
        for app in apps:
            server = start_server(app, directory, loop=loop, http=http, nodelay=args.nodelay)
            try:
                out["followers"][app] = await followers(server, args.followers, "f")
            finally:
                server.stop()
    return out


def _ratios(t: dict[str, Any], m: dict[str, Any]) -> dict[str, Any]:
    return {
        "turns_per_second": ratio(t["turns_per_second"], m["turns_per_second"]),
        "server_cpu_per_turn": ratio(t["server_cpu_us_per_turn"], m["server_cpu_us_per_turn"]),
        "first_delta_p50": ratio(t["first_delta_p50_ms"], m["first_delta_p50_ms"]),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    usable, missing = available_variants(args.variants)
    data: dict[str, Any] = {
        "benchmark": "serve",
        "config": {"apps": args.apps, "clients": args.clients, "seconds_per_point": args.seconds,
                   "followers": args.followers, "nodelay": args.nodelay,
                   "variants": usable, "variants_missing": missing,
                   "model": "EchoModel (delay 0)", "torpor_log_level": "info",
                   "servers": "separate processes via bench/_serve_launch.py: torpor.serve.bind "
                              "socket, uvicorn settings of torpor.serve.runner.serve"},
        "variants": {},
    }
    with tempfile.TemporaryDirectory(prefix="torpor-bench-serve-") as tmp:
        directory = Path(tmp)
        for name in usable:
            data["variants"][name] = await run_variant(name, args, directory)
        if not args.quick:
            data["in_process"] = await in_process(fresh_db(directory, "local.db"),
                                                  args.clients[0], args.seconds)
    first = data["variants"].get(usable[0]) if usable else None
    if first and "in_process" in data and "torpor" in first["turns"][0]:
        data["http_vs_in_process"] = ratio(first["turns"][0]["torpor"]["turns_per_second"],
                                           data["in_process"]["turns_per_second"])
    return data


SHORT = {"asyncio+h11": "aio+h11", "uvloop+httptools": "uv+httptools"}


def _tables(data: dict[str, Any]) -> list[Any]:
    apps = data["config"]["apps"]
    tables = []
    rows: list[tuple[Any, ...]] = []
    for long_name, v in data["variants"].items():
        name = SHORT[long_name]
        for point in v["turns"]:
            for app in apps:
                r = point[app]
                rows.append((name, app, r["clients"], r["turns_per_second"],
                             r["server_cpu_us_per_turn"], r["first_delta_p50_ms"],
                             r["first_delta_p99_ms"], r["client_cpu_us_per_turn"],
                             r["others_busy_cores"], r["failed"]))
            q = point.get("ratios")
            if q:
                rows.append((name, "torpor/minimal", point["clients"], q["turns_per_second"],
                             q["server_cpu_per_turn"], q["first_delta_p50"], None, None, None,
                             None))
    if "in_process" in data:
        r = data["in_process"]
        rows.append(("in-process", "torpor", r["clients"], r["turns_per_second"], None,
                     r["first_delta_p50_ms"], r["first_delta_p99_ms"],
                     r["client_cpu_us_per_turn"], r["others_busy_cores"], None))
    tables.append(table(f"SSE turns, {data['config']['seconds_per_point']} s a point, "
                        f"TCP_NODELAY {data['config']['nodelay']}",
                        ["loop+parser", "app", "clients", "turns/s", "server µs/turn",
                         "1st delta p50 ms", "p99", "client µs/turn", "others' cores",
                         "failed"], rows))
    rows = []
    for long_name, v in data["variants"].items():
        name = SHORT[long_name]
        for nd, by_app in v["keepalive"].items():
            for app in apps:
                r = by_app[app]
                rows.append((name, app, nd, r["healthz_p50_ms"], r["healthz_p99_ms"],
                             r["healthz_requests"], r["sse_turn_p50_ms"],
                             r["sse_first_delta_p50_ms"]))
    tables.append(table("keep-alive, one connection",
                        ["loop+parser", "app", "TCP_NODELAY", "GET /healthz p50 ms", "p99", "n",
                         "SSE turn p50 ms", "1st delta p50 ms"], rows))
    rows = []
    for long_name, v in data["variants"].items():
        name = SHORT[long_name]
        for app, f in v.get("followers", {}).items():
            for p in f["points"]:
                rows.append((name, app, p["followers"],
                             round((p["rss_after_bytes"] - p["rss_before_bytes"]) / 1e6, 1),
                             round(p["bytes_per_follower"] / 1024, 1), p["refused"],
                             f"{f['received_next_event']}/{f['followers']}",
                             f["fanout_seconds"]))
    if rows:
        tables.append(table("idle followers (an open SSE GET …/stream each): server RSS growth",
                            ["loop+parser", "app", "followers", "RSS growth MB",
                             "KB per follower", "refused", "got next event", "fan-out s"],
                            rows))
    c = data["conditions_at_start"]
    tables.append(table("conditions", ["what", "value"], [
        ("load average at start (1, 5, 15 min)", ", ".join(map(str, c["load"]))),
        ("load average at end", ", ".join(f"{x:.2f}" for x in os.getloadavg())),
        ("cores", os.cpu_count()),
        ("others' cores", "CPU the rest of the machine used during a point (from /proc/stat, "
                          "less the server's and this client's)"),
        *((f"{k} skipped", v) for k, v in data["config"]["variants_missing"].items()),
    ]))
    return tables


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized: 32 and 64 clients, 2 s a point, 200 and 1,000 followers")
    parser.add_argument("--clients", type=int, nargs="+", default=None)
    parser.add_argument("--seconds", type=float, default=None, help="seconds per turn point")
    parser.add_argument("--followers", type=int, nargs="*", default=None,
                        help="follower counts, ascending (none: skip)")
    parser.add_argument("--apps", nargs="+", choices=("torpor", "minimal", "lean"),
                        default=list(APPS), help="lean: the minimal app with a bare ASGI SSE "
                        "response instead of sse-starlette (what a leaner response saves)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--nodelay", choices=("on", "shipped"), default="on",
                        help="listening socket of the turn and follower points")
    parser.add_argument("--ka-seconds", type=float, default=None,
                        help="seconds cap of each keep-alive measurement")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    quick = args.quick
    args.clients = args.clients or ([32, 64] if quick else [32, 256])
    args.seconds = args.seconds or (2.0 if quick else 4.0)
    args.followers = args.followers if args.followers is not None else (
        [200, 1000] if quick else [1000, 10000])
    args.ka_seconds = args.ka_seconds or (1.0 if quick else 2.0)
    args.ka_requests = 100 if quick else 300
    load = os.getloadavg()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, max(args.followers or [0]) + 1024))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # the servers inherit it
    quiet()
    data = asyncio.run(main(args))
    data["conditions_at_start"] = {"load": [round(x, 2) for x in load]}
    emit(data, _tables(data), args.json)


if __name__ == "__main__":
    cli()
