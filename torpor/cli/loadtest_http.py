"""``torpor loadtest --url URL``: the load test against a running server, over HTTP.

Phases, like the in-process load test but through the chat API:

1. **activate**: every conversation receives one message (``POST …/messages``,
   its turn read as Server-Sent Events), ``--concurrency`` clients at a time.
2. **run** (``--duration`` seconds): a fraction R of the conversations take
   turns back to back, each its own SSE client on a kept-alive connection;
   returning users wake idle ones at ``--wake-rate``. A share of the turns
   (``--reconnect-ratio``) drops its connection after the first text delta and
   resumes with ``GET …/stream`` and ``Last-Event-ID``.

Every turn is checked: the logged events arrive once each with no position
missing, and the text deltas received for a message (across the drop) add up
to exactly its logged text. A reconnect that lost or duplicated text is
counted and makes the command exit 1: there must be none. Server-side figures
(agents per state over time, lifecycle counters, revival latency, RSS) come
from ``/admin/stats`` when the admin token is given. ``--timeout`` bounds both
phases (see :mod:`torpor.cli.loadtest_phases`): past it every client is
cancelled and closes its connection, and the report is marked ``timed_out``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import time
from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from torpor.cli.common import CliError, consoles, machine, write_json
from torpor.cli.loadtest_phases import Phases, default_timeout, plan_line
from torpor.cli.loadtest_report import print_phases, timed_out_line
from torpor.cli.progress import Bar, Progress
from torpor.runtime.stats import percentile

__all__ = ["TurnCheck", "print_http_summary", "run_http", "stream_turn"]

_TERMINAL = frozenset({"suspended", "aborted"})


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


class TurnCheck:
    """What one turn's client saw, across its connections, and whether it adds up."""

    __slots__ = ("draft", "duplicated", "final", "gaps", "lost", "positions", "repeats",
                 "turn", "user_position")

    def __init__(self) -> None:
        self.turn: int | None = None
        self.user_position: int | None = None
        self.positions: list[int] = []
        self.draft = ""  # deltas received since the last message that ended a draft
        self.final: str | None = None
        self.lost = 0
        self.duplicated = 0
        self.gaps = 0
        self.repeats = 0

    def event(self, name: str, data: Mapping[str, Any]) -> bool:
        """Account for one SSE event; True when it ends this turn."""
        if name == "delta":
            if data.get("offset") != len(self.draft):
                if data.get("offset", 0) < len(self.draft):
                    self.duplicated += 1
                else:
                    self.lost += 1
            self.draft += data["text"]
            return False
        if name == "error":
            return True
        position = int(data["position"])
        if self.positions:
            last = self.positions[-1]
            if position <= last:
                self.repeats += 1
                return False
            if position != last + 1:
                self.gaps += 1
        self.positions.append(position)
        kind = data["kind"]
        body = data["body"]
        if kind == "user" and self.turn is None:
            self.turn = int(data["turn"])
            self.user_position = position
        if kind in ("assistant", "aborted"):
            text = body.get("text", "") if kind == "assistant" else body.get("partial_text", "")
            if self.draft and body.get("artifact") is None and self.draft != text:
                if len(self.draft) > len(text) or not text.startswith(self.draft):
                    self.duplicated += 1
                else:
                    self.lost += 1
            self.draft = ""
            if kind == "assistant":
                self.final = text
        return (
            self.turn is not None and int(data["turn"]) == self.turn
            and (kind in _TERMINAL or (kind == "assistant" and not body.get("tool_calls")))
        )

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.gaps or self.repeats)


async def stream_turn(
    client: Any, conn: Any, conversation_id: str, text: str, *, drop: bool,
    check: TurnCheck, timing: dict[str, float],
) -> bool:
    """Send one message and read its turn; with ``drop``, cut the connection after the first
    delta and resume with Last-Event-ID. Returns whether a drop-and-resume happened."""
    from urllib.parse import quote

    path = f"/v1/conversations/{quote(conversation_id, safe='')}"
    started = time.perf_counter()
    _, response = await client.open("POST", path + "/messages", json_body={"text": text},
                                    headers={"Accept": "text/event-stream"}, conn=conn)
    if response.status != 200:
        body = await response.read()
        raise RuntimeError(f"HTTP {response.status}: {body[:200]!r}")
    last_id: str | None = None
    ended = False
    async for event in response.events():
        if ended:
            continue  # the server closes the stream right after the turn's end: read it all
        now = time.perf_counter()
        timing.setdefault("ttfb", now - started)
        if event.event == "delta":
            timing.setdefault("ttft", now - started)
        last_id = event.id or last_id
        if check.event(event.event, event.json()):
            timing["turn"] = time.perf_counter() - started
            ended = True
            continue
        if drop and event.event == "delta":
            conn.abort()
            break
    else:
        if ended:
            return False  # the body ended: the connection can carry the next request
        raise ConnectionResetError("the stream ended before the turn did")
    resume = client.connection()
    try:
        headers = {"Accept": "text/event-stream"}
        if last_id is not None:
            headers["Last-Event-ID"] = last_id
        _, response = await client.open("GET", path + "/stream", headers=headers, conn=resume)
        if response.status != 200:
            raise RuntimeError(f"resume: HTTP {response.status}")
        async for event in response.events():
            if check.event(event.event, event.json()):
                timing["turn"] = time.perf_counter() - started
                return True
        raise ConnectionResetError("the resumed stream ended before the turn did")
    finally:
        resume.abort()


class _Tally:
    def __init__(self) -> None:
        self.turns = 0
        self.turn_seconds: list[float] = []
        self.ttfb: list[float] = []
        self.ttft: list[float] = []
        self.wakes = 0
        self.wake_seconds: list[float] = []
        self.errors: Counter[str] = Counter()
        self.reconnects = 0
        self.reconnects_bad = 0
        self.lost = 0
        self.duplicated = 0
        self.gaps = 0
        self.repeats = 0

    def checked(self, check: TurnCheck, reconnected: bool) -> None:
        self.lost += check.lost
        self.duplicated += check.duplicated
        self.gaps += check.gaps
        self.repeats += check.repeats
        if reconnected:
            self.reconnects += 1
            if not check.ok:
                self.reconnects_bad += 1


async def _one_turn(client: Any, conn: Any, cid: str, text: str, drop: bool,
                    tally: _Tally) -> tuple[bool, dict[str, float]]:
    check = TurnCheck()
    timing: dict[str, float] = {}
    reconnected = await stream_turn(client, conn, cid, text, drop=drop, check=check,
                                    timing=timing)
    tally.checked(check, reconnected)
    if "ttfb" in timing:
        tally.ttfb.append(timing["ttfb"])
    if "ttft" in timing:
        tally.ttft.append(timing["ttft"])
    return reconnected, timing


async def run_http_phases(args: argparse.Namespace, bar: Progress) -> dict[str, Any]:
    from torpor.serve.client import Client, HTTPStatusError

    chat = Client(args.url, args.token)
    admin = Client(args.url, args.admin_token) if args.admin_token else None
    tally = _Tally()
    samples: list[dict[str, Any]] = []
    origin = time.perf_counter()
    phase = "activate"

    async def stats() -> dict[str, Any] | None:
        if admin is None:
            return None
        try:
            result: dict[str, Any] = await admin.call("GET", "/admin/stats")
        except (OSError, HTTPStatusError):
            return None
        return result

    first = await stats()
    if args.admin_token and first is None:
        raise CliError(f"{args.url}: /admin/stats refused the admin token or did not answer")

    async def sampler() -> None:
        while True:
            s = await stats()
            if s is not None:
                server = s.get("server", {})
                samples.append({
                    "t": round(time.perf_counter() - origin, 3), "phase": phase,
                    "states": s["states"], "live": s["live"], "hibernated": s["hibernated"],
                    "with_working_set": s["with_working_set"], "rss_bytes": server.get("rss_bytes"),
                    "turns": tally.turns, "open_streams": server.get("open_streams"),
                })
            await asyncio.sleep(max(0.2, args.duration / 60))

    run_id = secrets.token_hex(3)
    ids = [f"lt-{run_id}-{i:06d}" for i in range(args.agents)]
    rng = random.Random(args.seed)
    driven = rng.sample(ids, round(len(ids) * args.active_ratio))
    chosen = set(driven)
    idle = [c for c in ids if c not in chosen]
    phases = Phases(args.timeout or default_timeout(args.duration))
    activation_seconds: float | None = None
    activation_errors = 0
    run_started: float | None = None
    last: dict[str, Any] | None = None
    sampling = asyncio.create_task(sampler())
    try:
        async with phases.bound():
            # -- activate -----------------------------------------------------------------
            bar.phase("activate", len(ids))
            queue = list(reversed(ids))
            started = time.perf_counter()

            async def activator() -> None:
                conn = chat.connection()
                try:
                    while queue:
                        cid = queue.pop()
                        try:
                            await _one_turn(chat, conn, cid, "Hello, I am new here.", False, tally)
                        except (OSError, RuntimeError, ValueError) as exc:
                            tally.errors[type(exc).__name__] += 1
                            await conn.close()
                        bar.advance()
                finally:
                    await conn.close()

            with phases.timed("activate"):
                # A task group, not gather: cut by --timeout, it waits for every cancelled
                # client to close its connection before the phase ends.
                async with asyncio.TaskGroup() as clients:
                    for _ in range(min(args.concurrency, len(ids))):
                        clients.create_task(activator())
            activation_seconds = time.perf_counter() - started
            activation_errors = sum(tally.errors.values())
            bar.done()
            # -- run ----------------------------------------------------------------------
            phase = "run"
            tally.ttfb.clear()
            tally.ttft.clear()
            bar.phase("run", args.duration)
            run_started = time.monotonic()
            deadline = run_started + args.duration
            drop_rng = random.Random(args.seed + 2)

            async def driver(cid: str) -> None:
                conn = chat.connection()
                n = 0
                try:
                    while time.monotonic() < deadline:
                        drop = drop_rng.random() < args.reconnect_ratio
                        try:
                            _, timing = await _one_turn(chat, conn, cid, f"Turn {n}: anything new?",
                                                        drop, tally)
                        except (OSError, RuntimeError, ValueError) as exc:
                            tally.errors[type(exc).__name__] += 1
                            await conn.close()
                        else:
                            tally.turns += 1
                            if "turn" in timing:
                                tally.turn_seconds.append(timing["turn"])
                        n += 1
                        if args.think_time > 0:
                            await asyncio.sleep(args.think_time)
                finally:
                    await conn.close()

            async def wake(cid: str) -> None:
                conn = chat.connection()
                try:
                    _, timing = await _one_turn(chat, conn, cid, "Me again, after a while.",
                                                drop_rng.random() < args.reconnect_ratio, tally)
                    tally.wakes += 1
                    if "turn" in timing:
                        tally.wake_seconds.append(timing["turn"])
                except (OSError, RuntimeError, ValueError) as exc:
                    tally.errors[type(exc).__name__] += 1
                finally:
                    await conn.close()

            async def returning_users() -> None:
                if args.wake_rate <= 0 or not idle:
                    return
                sent = 0
                wake_rng = random.Random(args.seed + 1)
                async with asyncio.TaskGroup() as group:
                    while (now := time.monotonic()) < deadline:
                        due = int((now - run_started) * args.wake_rate) - sent
                        for _ in range(max(0, due)):
                            group.create_task(wake(wake_rng.choice(idle)))
                        sent += max(0, due)
                        await asyncio.sleep(min(0.05, 1 / args.wake_rate))

            async def ticker() -> None:
                while (now := time.monotonic()) < deadline:
                    bar.update(now - run_started)
                    await asyncio.sleep(0.2)

            with phases.timed("run"):
                async with asyncio.TaskGroup() as group:
                    group.create_task(ticker())
                    group.create_task(returning_users())
                    for cid in driven:
                        group.create_task(driver(cid))
            bar.done()
            last = await stats()
    finally:
        seconds = None if run_started is None else time.monotonic() - run_started
        sampling.cancel()
        await asyncio.wait([sampling])  # ended here, not left to run past the report
    server = (last or {}).get("server", {})
    rss = [s["rss_bytes"] for s in samples if s.get("rss_bytes")]
    run_errors = sum(tally.errors.values()) - activation_errors
    return {
        "command": "loadtest --url",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {
            "url": args.url, "agents": args.agents, "active_ratio": args.active_ratio,
            "duration": args.duration, "timeout": phases.timeout,
            "concurrency": args.concurrency,
            "reconnect_ratio": args.reconnect_ratio, "wake_rate": args.wake_rate,
            "think_time": args.think_time, "seed": args.seed,
        },
        **phases.report(),
        "activation": None if activation_seconds is None else {
            "agents": len(ids), "seconds": round(activation_seconds, 3),
            "agents_per_second": round(len(ids) / activation_seconds, 1)
            if activation_seconds > 0 else None,
            "errors": activation_errors,
        },
        "run": None if seconds is None else {
            "seconds": round(seconds, 3), "driven_agents": len(driven), "turns": tally.turns,
            "turns_per_second": round(tally.turns / seconds, 1) if seconds > 0 else None,
            "turn_p50_ms": _ms(percentile(tally.turn_seconds, 50)),
            "turn_p99_ms": _ms(percentile(tally.turn_seconds, 99)),
            "ttfb_p50_ms": _ms(percentile(tally.ttfb, 50)),
            "ttfb_p99_ms": _ms(percentile(tally.ttfb, 99)),
            "first_delta_p50_ms": _ms(percentile(tally.ttft, 50)),
            "first_delta_p99_ms": _ms(percentile(tally.ttft, 99)),
            "wakes": tally.wakes,
            "wake_p50_ms": _ms(percentile(tally.wake_seconds, 50)),
            "wake_p99_ms": _ms(percentile(tally.wake_seconds, 99)),
            "errors": dict(tally.errors), "run_errors": run_errors,
        },
        "reconnects": {
            "reconnects": tally.reconnects,
            "reconnects_that_lost_or_duplicated_text": tally.reconnects_bad,
            "lost": tally.lost, "duplicated": tally.duplicated,
            "position_gaps": tally.gaps, "repeated_events": tally.repeats,
        },
        "lifecycle": {k: (last or {}).get(k) for k in (
            "activations", "revivals", "hibernations", "evictions", "crashes", "restarts",
            "parks", "revival_p50_ms", "revival_p99_ms")},
        "memory": {
            "server_rss_start_bytes": rss[0] if rss else None,
            "server_rss_end_bytes": server.get("rss_bytes"),
            "server_rss_peak_bytes": max(rss) if rss else None,
        },
        "timeline": samples,
        "total_seconds": round(time.perf_counter() - origin, 3),
    }


def _n(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}{unit}" if isinstance(value, float) else f"{value:,}{unit}"


def print_http_summary(console: Console, report: Mapping[str, Any]) -> None:
    run, act, rec = report["run"], report["activation"], report["reconnects"]
    life, mem = report["lifecycle"], report["memory"]
    table = Table(title=f"torpor loadtest --url {report['config']['url']}: "
                        f"{report['config']['agents']:,} agents")
    table.add_column("figure")
    table.add_column("value", justify="right")

    def mb(value: Any) -> str:
        return "-" if value is None else f"{value / 1e6:,.1f} MB"

    rows: list[tuple[str, str]] = []
    if act is not None:
        rows.append(("activation", f"{_n(act['agents'])} agents in {act['seconds']:.1f} s "
                                   f"({_n(act['agents_per_second'])}/s)"))
    if run is not None:
        rows += [
            ("driven agents (SSE clients)", _n(run["driven_agents"])),
            ("turns/s", _n(run["turns_per_second"])),
            ("turn p50 / p99",
             f"{_n(run['turn_p50_ms'], ' ms')} / {_n(run['turn_p99_ms'], ' ms')}"),
            ("first byte p50 / p99", f"{_n(run['ttfb_p50_ms'], ' ms')} / "
                                     f"{_n(run['ttfb_p99_ms'], ' ms')}"),
            ("first text p50 / p99", f"{_n(run['first_delta_p50_ms'], ' ms')} / "
                                     f"{_n(run['first_delta_p99_ms'], ' ms')}"),
            ("returning users (wakes)", f"{_n(run['wakes'])}, "
                                        f"p50 {_n(run['wake_p50_ms'], ' ms')}, "
                                        f"p99 {_n(run['wake_p99_ms'], ' ms')}"),
        ]
    rows += [
        ("reconnects mid-stream", _n(rec["reconnects"])),
        ("reconnects that lost or duplicated text",
         _n(rec["reconnects_that_lost_or_duplicated_text"])),
        ("lost / duplicated / gaps / repeats (all turns)",
         f"{rec['lost']} / {rec['duplicated']} / {rec['position_gaps']} / "
         f"{rec['repeated_events']}"),
        ("revival p50 / p99 (server)", f"{_n(life['revival_p50_ms'], ' ms')} / "
                                       f"{_n(life['revival_p99_ms'], ' ms')}"),
        ("hibernations / evictions", f"{_n(life['hibernations'])} / {_n(life['evictions'])}"),
        ("crashes / restarts / parks", f"{_n(life['crashes'])} / {_n(life['restarts'])} / "
                                       f"{_n(life['parks'])}"),
        ("errors", str(sum((run or {"errors": {}})["errors"].values())
                       + (act["errors"] if act is not None and run is None else 0))),
        ("server RSS start / end / peak", f"{mb(mem['server_rss_start_bytes'])} / "
                                          f"{mb(mem['server_rss_end_bytes'])} / "
                                          f"{mb(mem['server_rss_peak_bytes'])}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    samples = report["timeline"]
    if samples:
        timeline = Table(title="server: agents per state over time")
        for name in ("t (s)", "phase", "live", "w/ ws", "hibern.", "streams", "turns", "RSS MB"):
            timeline.add_column(name, justify="right")
        step = max(1, len(samples) // 12)
        picked = samples[::step]
        if picked[-1] is not samples[-1]:
            picked.append(samples[-1])
        for s in picked:
            timeline.add_row(f"{s['t']:.1f}", s["phase"], f"{s['live']:,}",
                             f"{s['with_working_set']:,}", f"{s['hibernated']:,}",
                             _n(s.get("open_streams")), f"{s['turns']:,}",
                             mb(s.get("rss_bytes")).removesuffix(" MB"))
        console.print(timeline)
    print_phases(console, report)


def run_http(args: argparse.Namespace) -> int:
    if not args.url.startswith("http://"):
        raise CliError(f"--url: expected http://HOST:PORT, got {args.url!r}")
    if not args.token:
        raise CliError("--url needs the chat token: --token or TORPOR_TOKEN")
    for option, given in (("--db", args.db), ("--plot", args.plot), ("--keep-db", args.keep_db)):
        if given:
            raise CliError(f"{option} does not apply with --url (the server owns its store)")
    out, err = consoles(args.json)
    from torpor.serve.client import Client, HTTPStatusError

    async def probe() -> None:
        try:
            await Client(args.url, args.token).call("GET", "/healthz")
        except HTTPStatusError as exc:
            raise CliError(f"{args.url}: {exc}", code=1) from None
        except OSError as exc:
            raise CliError(f"cannot reach {args.url}: {exc.strerror or exc}", code=1) from None

    asyncio.run(probe())
    err.print(plan_line(args, f"activate ({args.agents:,} agents, one model turn each, "
                              f"{args.concurrency} at a time: agents x turn latency / "
                              f"{args.concurrency}), "), markup=False)
    with Bar(err) as bar:
        report = asyncio.run(run_http_phases(args, bar))
    print_http_summary(out, report)
    if args.json:
        write_json(args.json, report)
    bad = report["reconnects"]["reconnects_that_lost_or_duplicated_text"]
    rec = report["reconnects"]
    if bad or rec["lost"] or rec["duplicated"] or rec["position_gaps"] or rec["repeated_events"]:
        err.print("[red]text was lost or duplicated: see the reconnects figures[/]")
        return 1
    if report["timed_out"]:
        err.print(timed_out_line(report), markup=False)
        return 1
    return 0
