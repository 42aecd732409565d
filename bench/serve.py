"""The cost of HTTP: turns/s and time to first byte through `torpor serve` vs in-process.

Questions: what does the HTTP face (JSON in, Server-Sent Events out) cost a
turn, compared with calling the runtime in-process, in the same run on the
same machine? And what does one open, idle SSE connection cost the server?

1. **in-process**: ``--clients`` concurrent callers each take ``--turns``
   turns on their own conversation through ``Runtime.send`` and iterate the
   Turn. *First byte* is the first text delta; a turn ends at its answer.
2. **HTTP**: the same load against ``torpor serve --model echo`` in a
   subprocess, each client a kept-alive connection posting messages and
   reading the turn's SSE stream. *First byte* is the response's first body
   byte (the user message event), *first text* the first delta.
3. **idle streams**: ``--idle-streams`` connections follow (``GET …/stream``)
   conversations where nothing happens; the server's RSS before and after,
   over the count, is the memory per open idle SSE connection.

The model is the zero-latency EchoModel in both, so the difference is the
HTTP layer (and, for HTTP, the client's own parsing on the other core of a
two-core machine). Figures, never assertions.

Usage: ``python bench/serve.py [--clients 32] [--turns 40] [--idle-streams 1000] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, emit, fresh_db, quiet, table

import torpor
from torpor.runtime.stats import percentile
from torpor.serve.client import Client, Connection

TOKEN = "bench-" + secrets.token_hex(8)
ADMIN = "bench-admin-" + secrets.token_hex(8)


def _ms(samples: list[float], q: float) -> float | None:
    value = percentile(samples, q)
    return None if value is None else round(value * 1000, 3)


def _summary(turns: int, seconds: float, first_byte: list[float], first_text: list[float],
             turn: list[float]) -> dict[str, Any]:
    return {
        "turns": turns,
        "seconds": round(seconds, 3),
        "turns_per_second": round(turns / seconds, 1) if seconds > 0 else None,
        "first_byte_p50_ms": _ms(first_byte, 50),
        "first_byte_p99_ms": _ms(first_byte, 99),
        "first_text_p50_ms": _ms(first_text, 50),
        "first_text_p99_ms": _ms(first_text, 99),
        "turn_p50_ms": _ms(turn, 50),
        "turn_p99_ms": _ms(turn, 99),
    }


async def in_process(url: str, clients: int, turns: int) -> dict[str, Any]:
    first_byte: list[float] = []
    turn_seconds: list[float] = []
    async with torpor.Runtime(url, model=torpor.EchoModel()) as rt:
        for c in range(clients):  # activation, not timed (as over HTTP)
            await (await rt.send(f"p-{c}", "hello")).result()

        async def client(c: int) -> None:
            for n in range(turns):
                started = time.perf_counter()
                turn = await rt.send(f"p-{c}", f"turn {n}: anything new?")
                first = None
                async for item in turn:
                    if first is None and isinstance(item, torpor.TextDelta):
                        first = time.perf_counter() - started
                if first is not None:
                    first_byte.append(first)
                turn_seconds.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        seconds = time.perf_counter() - started
    return _summary(clients * turns, seconds, first_byte, first_byte, turn_seconds)


def start_server(db: str) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "torpor", "serve", "--db", db, "--port", "0", "--model", "echo",
         "--token", TOKEN, "--admin-token", ADMIN, "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT,
    )
    assert process.stdout is not None
    first = process.stdout.readline()
    if "listening on " not in first:
        process.kill()
        raise RuntimeError(f"torpor serve did not start: {first!r}")
    return process, first.split("listening on ", 1)[1].split("/ ", 1)[0]


def server_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def over_http(url: str, clients: int, turns: int) -> dict[str, Any]:
    client = Client(url, TOKEN)
    first_byte: list[float] = []
    first_text: list[float] = []
    turn_seconds: list[float] = []

    async def one(conn: Connection, cid: str, text: str, record: bool) -> None:
        started = time.perf_counter()
        _, response = await client.open(
            "POST", f"/v1/conversations/{cid}/messages", json_body={"text": text},
            headers={"Accept": "text/event-stream"}, conn=conn)
        byte = text_at = None
        async for event in response.events():
            now = time.perf_counter() - started
            byte = now if byte is None else byte
            if event.event == "delta" and text_at is None:
                text_at = now
        if record:
            turn_seconds.append(time.perf_counter() - started)
            if byte is not None:
                first_byte.append(byte)
            if text_at is not None:
                first_text.append(text_at)

    connections = [client.connection() for _ in range(clients)]
    for c, conn in enumerate(connections):
        await one(conn, f"h-{c}", "hello", False)

    async def run(c: int) -> None:
        for n in range(turns):
            await one(connections[c], f"h-{c}", f"turn {n}: anything new?", True)

    started = time.perf_counter()
    await asyncio.gather(*(run(c) for c in range(clients)))
    seconds = time.perf_counter() - started
    for conn in connections:
        await conn.close()
    return _summary(clients * turns, seconds, first_byte, first_text, turn_seconds)


async def idle_streams(url: str, pid: int, count: int) -> dict[str, Any]:
    client = Client(url, TOKEN)
    admin = Client(url, ADMIN)
    # warm up: one stream opened and closed, so one-off allocations are not counted
    conn = client.connection()
    await client.open("GET", "/v1/conversations/idle-warm/stream", conn=conn)
    conn.abort()
    while (await admin.call("GET", "/admin/stats"))["server"]["open_streams"]:  # noqa: ASYNC110
        await asyncio.sleep(0.05)  # a figure, not a test: polling the server is fine
    before = server_rss(pid)
    connections = [client.connection() for _ in range(count)]

    async def open_one(i: int) -> None:
        _, response = await client.open("GET", f"/v1/conversations/idle-{i}/stream",
                                        conn=connections[i])
        assert response.status == 200

    for start in range(0, count, 200):  # a few hundred at a time: no accept-queue overflow
        await asyncio.gather(*(open_one(i) for i in range(start, min(count, start + 200))))
    stats = await admin.call("GET", "/admin/stats")
    opened = stats["server"]["open_streams"]
    after = server_rss(pid)
    for conn in connections:
        conn.abort()
    return {
        "streams": count,
        "open_streams_seen_by_server": opened,
        "server_rss_before_bytes": before,
        "server_rss_after_bytes": after,
        "bytes_per_idle_stream": round((after - before) / count) if count else None,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="torpor-bench-serve-") as tmp:
        directory = Path(tmp)
        process, url = start_server(fresh_db(directory, "http.db"))
        try:
            http = await over_http(url, args.clients, args.turns)
            idle = await idle_streams(url, process.pid, args.idle_streams)
        finally:
            process.terminate()
            process.wait(timeout=60)
        local = await in_process(fresh_db(directory, "local.db"), args.clients, args.turns)
    return {
        "benchmark": "serve",
        "config": {"clients": args.clients, "turns_per_client": args.turns,
                   "idle_streams": args.idle_streams, "model": "EchoModel (delay 0)",
                   "server": "torpor serve --model echo, a subprocess (uvicorn, one process)"},
        "in_process": local,
        "http": http,
        "http_vs_in_process": {
            "throughput_ratio": round(http["turns_per_second"] / local["turns_per_second"], 3)
            if http["turns_per_second"] and local["turns_per_second"] else None,
            "first_byte_p50_added_ms": round(http["first_byte_p50_ms"]
                                             - local["first_byte_p50_ms"], 3)
            if http["first_byte_p50_ms"] is not None and local["first_byte_p50_ms"] is not None
            else None,
        },
        "idle_sse": idle,
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--turns", type=int, default=40, help="turns per client")
    parser.add_argument("--idle-streams", type=int, default=1000)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, args.idle_streams * 2 + 256))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    quiet()
    data = asyncio.run(main(args))
    local, http, idle = data["in_process"], data["http"], data["idle_sse"]
    rows = [
        (name, r["turns_per_second"], r["first_byte_p50_ms"], r["first_byte_p99_ms"],
         r["first_text_p50_ms"], r["first_text_p99_ms"], r["turn_p50_ms"], r["turn_p99_ms"])
        for name, r in (("in-process", local), ("HTTP (SSE)", http))
    ]
    tables = [
        table(f"{args.clients} clients x {args.turns} turns, EchoModel",
              ["path", "turns/s", "1st byte p50 ms", "p99", "1st text p50 ms", "p99",
               "turn p50 ms", "p99"], rows),
        table("open idle SSE connections (server RSS)",
              ["streams", "RSS before MB", "RSS after MB", "bytes per stream"],
              [(idle["streams"], round(idle["server_rss_before_bytes"] / 1e6, 1),
                round(idle["server_rss_after_bytes"] / 1e6, 1), idle["bytes_per_idle_stream"])]),
    ]
    emit(data, tables, args.json)


if __name__ == "__main__":
    cli()
