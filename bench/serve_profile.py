"""Where a turn's server CPU goes: `torpor serve` against the minimal app, profiled over HTTP.

Each app (bench/serve.py's servers: same socket, uvicorn settings and client load) takes
``--clients`` concurrent SSE turns for ``--seconds`` while a profiler samples the server:

- **py-spy** when it is on PATH (or ``--py-spy PATH``): ``py-spy record --format raw``,
  every thread, non-blocking. Each sample is put in one bucket by its innermost frame
  that is not generic plumbing (asyncio, anyio, contextlib, …): that frame's code says
  what the CPU was for (routing, authorize, JSON, SSE framing, the follower, logging,
  metrics, the store, the actor/turn machinery, uvicorn + the HTTP parser). A torpor
  line that calls msgspec counts as JSON. Samples none of whose frames is specific are
  the event loop's own.
- **cProfile** otherwise (``--cprofile`` forces it): the server runs under it from
  SIGUSR1 to SIGUSR2 (bench/_serve_launch.py), event-loop thread only; each function's
  own time goes to the bucket of its file (coarser: time in generic code stays there).

The bucket shares times the server CPU per turn measured over the same window (utime +
stime, /proc) give µs per turn; the table sets torpor's buckets against the minimal
app's. The profiler itself slows the server a little (both apps alike). Figures, never
assertions.

Usage: ``python bench/serve_profile.py [--clients 32] [--seconds 10] [--variant asyncio+h11]
[--rate 250] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import linecache
import os
import pstats
import shutil
import signal
import subprocess
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from _common import emit, quiet, table
from serve import APPS, VARIANTS, start_server, turn_load

GENERIC = (
    "/asyncio/", "/anyio/", "contextlib.py", "threading.py", "selectors.py", "/socket.py",
    "typing.py", "/abc.py", "/enum.py", "functools.py", "/concurrent/", "/queue.py",
    "weakref", "<frozen", "dataclasses.py", "/re/", "/re.py", "/collections/", "/copy.py",
    "inspect.py", "/secrets.py", "/random.py", "/uuid.py", "/base64.py", "/hmac.py",
    "_weakrefset.py", "/sniffio/", "/types.py", "/operator.py", "/string.py", "<string>",
    "/uvloop/", "/heapq.py", "/traceback.py", "/linecache.py", "/reprlib.py",
    # the roots of every stack (the launcher, torpor's CLI starting the loop): not a cost
    "_serve_launch.py", "torpor/cli/", "torpor/__main__.py",
)
# (substring of the file path, bucket); the first that matches names the frame's bucket.
BUCKETS = (
    ("/logging/", "logging (stdlib handlers, records)"),
    ("structlog", "logging (structlog)"),
    ("torpor/_logging", "logging (torpor's logger)"),
    ("torpor/serve/logs.py", "logging (JSON formatter, context filter)"),
    ("prometheus_client", "metrics (prometheus_client)"),
    ("torpor/serve/metrics.py", "metrics (torpor's counters, log tap)"),
    ("msgspec", "JSON encode/decode"),
    ("/json/", "JSON encode/decode"),
    ("sse_starlette/event.py", "SSE framing (sse-starlette ServerSentEvent)"),
    ("sse_starlette/", "sse-starlette response (task group, ping, disconnect watch)"),
    ("torpor/serve/sse_response.py", "SSE response (torpor's lean ASGI response, pings)"),
    ("torpor/serve/sse.py", "SSE framing (torpor Framer, cursors)"),
    ("torpor/serve/streams.py", "follower → SSE glue (serve/streams.py)"),
    ("torpor/actors/stream.py", "follower / subscription (hub, Follower)"),
    ("torpor/serve/access.py", "authorize (bearer token)"),
    ("torpor/serve/app.py", "request middleware (request id, access record)"),
    ("torpor/serve/", "torpor HTTP handlers (chat, service, proxy, problems)"),
    ("starlette/routing.py", "Starlette routing"),
    ("starlette/", "Starlette request/response/middleware"),
    ("uvicorn/", "HTTP server (uvicorn protocol + parser)"),
    ("/h11/", "HTTP server (uvicorn protocol + parser)"),
    ("httptools", "HTTP server (uvicorn protocol + parser)"),
    ("torpor/store/sqlite/reads.py", "store reads (the follower's replay, heads)"),
    ("torpor/store/", "store writes (group commit, SQLite)"),
    ("sqlite3", "store writes (group commit, SQLite)"),
    ("aiosqlite", "aiosqlite worker thread (hand-offs, SQLite)"),
    ("torpor/runtime/host.py", "runtime send/subscribe (host.py)"),
    ("torpor/", "actor / turn machinery (actors, runtime, llm, events)"),
    ("_serve_minimal.py", "minimal app handlers"),
)
JSON_CALLS = ("_encode(", "_decode.", "msgspec.", "json.dumps", "json.loads", ".encode(frame")


def _frame_parts(frame: str) -> tuple[str, str, int]:
    """``func (path:line)`` -> (func, path, line)."""
    func, _, where = frame.rpartition(" (")
    path, _, line = where.rstrip(")").rpartition(":")
    return func, path, int(line) if line.isdigit() else 0


def bucket_of(path: str, line: int) -> str | None:
    if any(g in path for g in GENERIC):
        return None
    for part, name in BUCKETS:
        if part in path:
            if name.startswith(("follower", "torpor HTTP", "request", "runtime", "actor",
                                "SSE framing (torpor", "minimal")) and line:
                source = linecache.getline(path, line)
                if any(call in source for call in JSON_CALLS):
                    return "JSON encode/decode"
            return name
    if "site-packages" in path:
        return "other library: " + path.split("site-packages/", 1)[1].split("/", 1)[0]
    return "other: " + Path(path).name


def classify_raw(text: str) -> tuple[Counter[str], Counter[str], int, dict[str, Counter[str]]]:
    """py-spy raw (collapsed) stacks -> samples per bucket, per thread, total, and per
    bucket the frames that named it (``func file:line``)."""
    buckets: Counter[str] = Counter()
    where: dict[str, Counter[str]] = {}
    threads: Counter[str] = Counter()
    total = 0
    for row in text.splitlines():
        stack, _, count_text = row.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = frames[0] if frames and frames[0].startswith(("thread", "process")) else ""
        name = None
        spot = "loop"
        for frame in reversed(frames[1:] if thread else frames):
            if " (" not in frame:
                continue
            func, path, line = _frame_parts(frame)
            name = bucket_of(path, line)
            if name is not None:
                spot = f"{func} {'/'.join(path.split('/')[-2:])}:{line}"
                break
        name = name or "event loop (asyncio/uvloop, selectors)"
        buckets[name] += count
        where.setdefault(name, Counter())[spot] += count
        label = thread.split(": ", 1)[-1].split(" (", 1)[-1].rstrip(")") if thread else "?"
        threads[label] += count  # MainThread, _connection_worker_thread (aiosqlite), …
        total += count
    return buckets, threads, total, where


def classify_pstats(path: str) -> tuple[Counter[str], int]:
    """cProfile stats -> own time (µs) per bucket of the function's file, and the total."""
    stats = pstats.Stats(path)
    buckets: Counter[str] = Counter()
    total = 0
    for (file, _line, _func), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        micro = int(tottime * 1e6)
        name = bucket_of(file, 0) or "generic (asyncio, anyio, stdlib) own time"
        if file == "~":
            name = "built-ins (C calls: JSON, socket, sqlite3, …)"
        buckets[name] += micro
        total += micro
    return buckets, total


async def profile_app(app: str, args: argparse.Namespace, directory: Path,
                      spy: str | None) -> dict[str, Any]:
    loop, http = VARIANTS[args.variant]
    target = directory / f"{app}.prof"
    extra = [] if spy else ["--cprofile", str(target)]
    server = start_server(app, directory, loop=loop, http=http, nodelay=args.nodelay,
                          extra=extra)
    try:
        await turn_load(server, args.clients, 1.0, "warm")  # caches, agents: not profiled
        if spy:
            raw = directory / f"{app}.raw"
            recorder = subprocess.Popen(  # noqa: ASYNC220 - starts at once, awaited below
                [spy, "record", "--pid", str(server.pid), "--rate", str(args.rate),
                 "--format", "raw", "--output", str(raw), "--threads", "--nonblocking",
                 "--full-filenames",
                 "--duration", str(int(args.seconds) + 1)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            await asyncio.sleep(0.5)  # py-spy attaches
            load = await turn_load(server, args.clients, args.seconds, "p")
            await asyncio.to_thread(recorder.wait, 60)
            buckets, threads, total, where = classify_raw(raw.read_text())
            unit = "samples"
        else:
            os.kill(server.pid, signal.SIGUSR1)
            load = await turn_load(server, args.clients, args.seconds, "p")
            os.kill(server.pid, signal.SIGUSR2)
            for _ in range(100):
                if target.exists() and target.stat().st_size:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.3)
            buckets, total = classify_pstats(str(target))
            threads, where = Counter(), {}
            unit = "µs own time (event-loop thread)"
    finally:
        server.stop()
    per_turn = load["server_cpu_us_per_turn"] or 0
    shares = {name: count / total for name, count in buckets.most_common()} if total else {}
    return {
        "load": load, "profiler": "py-spy" if spy else "cProfile", "unit": unit,
        "total": total,
        "buckets": {name: {"share": round(share, 4), "us_per_turn": round(share * per_turn),
                           "top_frames": {spot: round(n / total * per_turn) for spot, n
                                          in where.get(name, Counter()).most_common(6)}}
                    for name, share in shares.items()},
        "threads": {name: round(count / total, 4) for name, count in threads.most_common(8)}
        if total else {},
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    spy = None if args.cprofile else (args.py_spy or shutil.which("py-spy"))
    with tempfile.TemporaryDirectory(prefix="torpor-bench-serve-profile-") as tmp:
        result = {app: await profile_app(app, args, Path(tmp), spy) for app in APPS}
    return {"benchmark": "serve_profile",
            "config": {"clients": args.clients, "seconds": args.seconds,
                       "variant": args.variant, "nodelay": args.nodelay, "rate": args.rate},
            **result}


def _tables(data: dict[str, Any]) -> list[Any]:
    t, m = data["torpor"], data["minimal"]
    names = list(t["buckets"])
    names += [n for n in m["buckets"] if n not in t["buckets"]]
    rows = []
    for name in names:
        tb, mb = t["buckets"].get(name), m["buckets"].get(name)
        rows.append((name, round(tb["share"] * 100, 1) if tb else None,
                     tb["us_per_turn"] if tb else None,
                     round(mb["share"] * 100, 1) if mb else None,
                     mb["us_per_turn"] if mb else None,
                     (tb["us_per_turn"] if tb else 0) - (mb["us_per_turn"] if mb else 0)))
    lt, lm = t["load"], m["load"]
    title = (f"server CPU per turn by bucket ({t['profiler']}, {data['config']['variant']}, "
             f"{data['config']['clients']} clients): torpor {lt['server_cpu_us_per_turn']} µs "
             f"at {lt['turns_per_second']}/s, minimal {lm['server_cpu_us_per_turn']} µs at "
             f"{lm['turns_per_second']}/s")
    return [table(title, ["bucket", "torpor %", "µs/turn", "minimal %", "µs/turn",
                          "torpor - minimal µs"], rows)]


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--variant", choices=list(VARIANTS), default="asyncio+h11")
    parser.add_argument("--nodelay", choices=("on", "shipped"), default="on")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--py-spy", metavar="PATH", help="the py-spy binary (default: PATH)")
    parser.add_argument("--cprofile", action="store_true", help="cProfile even with py-spy")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    quiet()
    data = asyncio.run(main(args))
    emit(data, _tables(data), args.json)


if __name__ == "__main__":
    cli()
