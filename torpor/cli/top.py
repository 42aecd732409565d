"""``torpor top --url URL``: a live view of a running server's agents, like ``htop``.

Redrawn whenever the admin's watch stream reports lifecycle transitions (at
most four times a second) and at least every ``--interval`` seconds: agents
per state, revivals/s and turns/s, turn latency p50/p99, time to first token,
the server's RSS, model errors by type, aborted turns by reason, pending
approvals (how many, the oldest's age), the busiest agents (most transitions in
the last ten seconds) and the parked ones. Reads ``/admin/stats``, ``/admin/agents`` and
``/admin/watch`` with the admin token. Piped, it prints one frame per redraw.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections import Counter, deque
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from torpor.cli.common import CliError, positive_float, positive_int

__all__ = ["Top", "add_parser", "run"]

BUSY_WINDOW = 10.0  # seconds of transitions that make an agent "busy"
MIN_REDRAW = 0.25


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "top",
        help="a live terminal view of a running torpor server's agents",
        description="Watch a running `torpor serve` (or any app made by torpor.serve.app): "
                    "agents per state, revivals/s, turns/s, latency, RSS, busiest and parked "
                    "agents, redrawn from the admin's watch stream.",
    )
    p.add_argument("--url", required=True, help="the server's base URL (http://127.0.0.1:8000)")
    p.add_argument("--admin-token", default=os.environ.get("TORPOR_ADMIN_TOKEN"),
                   help="the admin token (env TORPOR_ADMIN_TOKEN)")
    p.add_argument("--interval", type=positive_float, default=1.0, metavar="SEC",
                   help="redraw at least this often (default 1 s)")
    p.add_argument("--frames", type=positive_int, default=None, metavar="N",
                   help="exit after N redraws (default: until Ctrl-C)")
    p.set_defaults(run=run)


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:,.1f} ms"


class Top:
    """The view's state: the last stats, rates between redraws, recent transitions."""

    def __init__(self, url: str, token: str) -> None:
        from torpor.serve.client import Client

        self.url = url
        self.client = Client(url, token)
        self.recent: deque[tuple[float, str]] = deque(maxlen=50_000)
        self.changed = asyncio.Event()
        self.connected = False
        self.stats: dict[str, Any] = {}
        self.parked: list[dict[str, Any]] = []
        self._previous: tuple[float, int, int] | None = None
        self.revivals_per_s: float | None = None
        self.turns_per_s: float | None = None
        self.transitions = 0

    async def watch(self) -> None:
        """Follow /admin/watch for ever (reconnecting); every transition asks for a redraw."""
        while True:
            try:
                conn, response = await self.client.open(
                    "GET", "/admin/watch", headers={"Accept": "text/event-stream"}
                )
                try:
                    if response.status != 200:
                        await asyncio.sleep(1.0)
                        continue
                    async for event in response.events():
                        if event.event == "transition":
                            data = event.json()
                            self.recent.append((time.monotonic(), data["conversation_id"]))
                            self.transitions += 1
                            self.changed.set()
                finally:
                    await conn.close()
            except (OSError, ValueError):
                pass
            self.connected = False
            self.changed.set()
            await asyncio.sleep(1.0)

    async def refresh(self) -> None:
        from torpor.serve.client import HTTPStatusError

        try:
            self.stats = await self.client.call("GET", "/admin/stats")
            self.parked = await self.client.call("GET", "/admin/agents?state=parked")
        except (OSError, HTTPStatusError):  # gone, or shutting down (503): keep trying
            self.connected = False
            return
        self.connected = True
        now = time.monotonic()
        revivals = int(self.stats.get("revivals", 0))
        turns = int(self.stats.get("server", {}).get("turns", 0))
        if self._previous is not None:
            then, old_revivals, old_turns = self._previous
            elapsed = max(1e-6, now - then)
            self.revivals_per_s = (revivals - old_revivals) / elapsed
            self.turns_per_s = (turns - old_turns) / elapsed
        self._previous = (now, revivals, turns)

    def busiest(self, n: int = 5) -> list[tuple[str, int]]:
        horizon = time.monotonic() - BUSY_WINDOW
        while self.recent and self.recent[0][0] < horizon:
            self.recent.popleft()
        return Counter(cid for _, cid in self.recent).most_common(n)

    def render(self) -> Group:
        stats = self.stats
        server = stats.get("server", {})
        # One line at any width: cut short (an ellipsis), never wrapped onto a second.
        title = Text(f"torpor top  {self.url}  {time.strftime('%H:%M:%S')}", style="bold",
                     no_wrap=True, overflow="ellipsis")
        if not self.connected:
            title.append("  (disconnected: retrying)", style="red")
        states = _table("agents per state", show_header=True)
        states.add_column("state")
        states.add_column("agents", justify="right")
        for name, count in sorted(stats.get("states", {}).items()):
            states.add_row(name, f"{count:,}")
        for name in ("live", "hibernated", "queued"):
            if name in stats:
                states.add_row(f"({name})", f"{stats[name]:,}")
        figures = _table("runtime", show_header=False)
        figures.add_column("figure")
        figures.add_column("value", justify="right")
        rss = server.get("rss_bytes")
        for name, value in (
            ("revivals/s", "-" if self.revivals_per_s is None else f"{self.revivals_per_s:,.1f}"),
            ("turns/s", "-" if self.turns_per_s is None else f"{self.turns_per_s:,.1f}"),
            ("turn p50 / p99", f"{_ms(server.get('turn_p50_ms'))} / "
                               f"{_ms(server.get('turn_p99_ms'))}"),
            ("first token p50 / p99", f"{_ms(server.get('ttft_p50_ms'))} / "
                                      f"{_ms(server.get('ttft_p99_ms'))}"),
            ("revival p50 / p99", f"{_ms(stats.get('revival_p50_ms'))} / "
                                  f"{_ms(stats.get('revival_p99_ms'))}"),
            ("RSS", "-" if rss is None else f"{rss / 1e6:,.1f} MB"),
            ("open streams", f"{server.get('open_streams', 0):,}"),
            ("turns / revivals total", f"{server.get('turns', 0):,} / "
                                       f"{stats.get('revivals', 0):,}"),
            ("crashes / parks", f"{stats.get('crashes', 0):,} / {stats.get('parks', 0):,}"),
        ):
            figures.add_row(name, value)
        failures = _table("failures", show_header=False)
        failures.add_column("figure")
        failures.add_column("value", no_wrap=True, overflow="ellipsis")
        pending = stats.get("pending", {})
        for name, value in (
            ("model errors", _by_kind(server.get("model_errors", {}))),
            ("aborted turns", _by_kind(server.get("aborted", {}))),
            ("pending approvals", f"{pending.get('conversations', 0):,} "
                                  f"(oldest {_age(pending.get('oldest_seconds'))})"),
        ):
            failures.add_row(name, value)
        busy = _table(f"busiest (last {BUSY_WINDOW:g} s)")
        busy.add_column("conversation")
        busy.add_column("transitions", justify="right")
        for cid, count in self.busiest():
            busy.add_row(cid, str(count))
        parked = _table("parked")
        parked.add_column("conversation")
        parked.add_column("cause")
        for info in self.parked[:10]:
            parked.add_row(info.get("conversation_id", "?"), str(info.get("parked_cause") or ""))
        if not self.parked:
            parked.add_row("(none)", "")
        return Group(title, states, figures, failures, busy, parked)


def _table(title: str, **options: Any) -> Table:
    """A table at least as wide as its title, which then never wraps."""
    return Table(title=title, expand=False, min_width=len(title) + 4, **options)


def _by_kind(counts: dict[str, int]) -> str:
    """``7 (ModelRateLimited 4, ModelTimeout 3)``: the total, then the commonest kinds."""
    total = sum(counts.values())
    if not total:
        return "0"
    top = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:3]
    more = ", …" if len(counts) > 3 else ""
    return f"{total:,} (" + ", ".join(f"{k} {n:,}" for k, n in top) + more + ")"


def _age(seconds: Any) -> str:
    if not isinstance(seconds, int | float) or seconds <= 0:
        return "-"
    if seconds < 120:
        return f"{seconds:,.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.0f} min"
    return f"{seconds / 3600:,.1f} h"


async def _check(top: Top) -> None:
    from torpor.serve.client import HTTPStatusError

    try:
        await top.client.call("GET", "/admin/stats")
    except HTTPStatusError as exc:
        code = 2 if exc.status in (401, 403, 404) else 1
        raise CliError(f"{top.url}: {exc}", code=code) from None
    except OSError as exc:
        raise CliError(f"cannot reach {top.url}: {exc.strerror or exc}", code=1) from None


async def _top(args: argparse.Namespace, console: Console) -> None:
    top = Top(args.url.rstrip("/"), args.admin_token)
    await _check(top)
    watching = asyncio.create_task(top.watch())
    frames = 0
    live = Live(console=console, auto_refresh=False, transient=False) if console.is_terminal \
        else None
    try:
        if live is not None:
            live.start()
        while args.frames is None or frames < args.frames:
            await top.refresh()
            frames += 1
            if live is not None:
                live.update(top.render(), refresh=True)
            else:
                console.print(top.render())
                console.print(f"-- frame {frames} --", highlight=False)
                console.file.flush()
            if args.frames is not None and frames >= args.frames:
                break
            top.changed.clear()
            with contextlib.suppress(TimeoutError):  # not wait_for: it can lose a Ctrl-C
                async with asyncio.timeout(args.interval):
                    await top.changed.wait()
            await asyncio.sleep(MIN_REDRAW)  # at most four redraws a second
    finally:
        if live is not None:
            live.stop()
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching


def run(args: argparse.Namespace) -> int:
    if not args.admin_token:
        raise CliError("--admin-token (or TORPOR_ADMIN_TOKEN) is required")
    if not args.url.startswith("http://"):
        raise CliError(f"--url: expected http://HOST:PORT, got {args.url!r}")
    console = Console(highlight=False)
    try:
        asyncio.run(_top(args, console))
    except KeyboardInterrupt:
        return 0
    return 0
