"""``torpor loadtest``: thousands of agents with history, a few busy, the rest left to sleep.

The defaults (10,000 agents) finish in well under a minute on two cores with
no configuration: history goes straight into a temporary SQLite file through
the store, then the runtime activates, drives and retires the agents on a
lifecycle schedule compressed to the run's duration. ``--duration`` is the run
phase's length; the other phases come on top, and ``--timeout`` bounds them
all (see :mod:`torpor.cli.loadtest_phases`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torpor.cli.common import (
    CliError,
    consoles,
    display_url,
    machine,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    ratio,
    store_url,
    to_jsonable,
    write_json,
)
from torpor.cli.history import build_history
from torpor.cli.loadtest_phases import Phases, default_timeout, plan_line
from torpor.cli.loadtest_report import (
    check_plot_available,
    plot_timeline,
    print_summary,
    timed_out_line,
)
from torpor.cli.loadtest_run import RunPlan, RunResult, run_phases
from torpor.cli.progress import Bar
from torpor.errors import ConfigError
from torpor.runtime import RuntimeConfig

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "loadtest",
        help="create N agents with history, drive a fraction, let the rest hibernate and evict",
        description="Load test: N conversations with M events each (a temporary SQLite file, "
                    "or --db, SQLite or PostgreSQL); activate them "
                    "all, drive a fraction R with turns for S seconds while the lifecycle "
                    "hibernates and evicts the idle ones; report agents per state over time, "
                    "memory per agent per state, turns/s and revival latency.",
    )
    p.add_argument("--agents", "-n", type=positive_int, default=10_000, metavar="N",
                   help="conversations / agents (default 10000)")
    p.add_argument("--history", "-m", type=non_negative_int, default=20, metavar="M",
                   help="events of history per conversation (default 20)")
    p.add_argument("--active-ratio", "-r", type=ratio, default=0.1, metavar="R",
                   help="fraction of agents driven with turns (default 0.1)")
    p.add_argument("--duration", "-d", type=positive_float, default=20.0, metavar="S",
                   help="seconds of mixed load after activation (default 20)")
    p.add_argument("--timeout", type=positive_float, default=None, metavar="S",
                   help="wall-clock bound on the whole command: past it the phase under way "
                        "is cancelled, the report (marked timed_out) shows the phases that "
                        "ran, and the exit status is 1 (default: 120 + 2 x --duration)")
    p.add_argument("--db", type=store_url, default=None, metavar="URL",
                   help="store URL (default: a temporary SQLite file, deleted afterwards)")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON ('-' for stdout)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw agents per state and RSS over time (needs torpor[plot])")
    p.add_argument("--hibernate-after", type=positive_float, metavar="SEC",
                   help="idle seconds before hibernation (default: 20%% of --duration)")
    p.add_argument("--evict-after", type=positive_float, metavar="SEC",
                   help="idle seconds before eviction (default: 50%% of --duration)")
    p.add_argument("--wake-rate", type=non_negative_float, default=20.0, metavar="PER_S",
                   help="messages/s to random idle agents during the run (default 20)")
    p.add_argument("--think-time", type=non_negative_float, default=0.0, metavar="SEC",
                   help="pause of a driven agent between turns (default 0)")
    p.add_argument("--probe-agents", type=non_negative_int, default=1000, metavar="K",
                   help="agents measured per state with tracemalloc at the end (0: skip)")
    p.add_argument("--max-live-agents", type=positive_int, default=None, metavar="N",
                   help="cap on agents in memory (default: the runtime's)")
    p.add_argument("--revival-cap", type=positive_int, default=None, metavar="N",
                   help="max concurrent revivals (default: the runtime's)")
    p.add_argument("--seed", type=int, default=0, help="seed for the synthetic load")
    p.add_argument("--keep-db", action="store_true", help="keep the temporary database")
    http = p.add_argument_group(
        "over HTTP", "--url drives a running `torpor serve` through its chat API instead of an "
                     "in-process runtime: concurrent SSE clients, a share of which disconnect "
                     "mid-stream and resume with Last-Event-ID (see torpor.cli.loadtest_http)")
    http.add_argument("--url", metavar="URL", help="the server's base URL (http://127.0.0.1:8000)")
    http.add_argument("--token", default=os.environ.get("TORPOR_TOKEN"),
                      help="the chat token (env TORPOR_TOKEN)")
    http.add_argument("--admin-token", default=os.environ.get("TORPOR_ADMIN_TOKEN"),
                      help="the admin token, for the server's figures (env TORPOR_ADMIN_TOKEN)")
    http.add_argument("--reconnect-ratio", type=ratio, default=0.2, metavar="R",
                      help="share of turns that drop mid-stream and resume (default 0.2)")
    http.add_argument("--concurrency", type=positive_int, default=64, metavar="N",
                      help="clients activating conversations at once (default 64)")
    p.set_defaults(run=run)


def _runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    hibernate_after = args.hibernate_after or max(0.2, args.duration * 0.2)
    evict_after = args.evict_after or max(hibernate_after, args.duration * 0.5)
    extra: dict[str, Any] = {}
    if args.max_live_agents is not None:
        extra["max_live_agents"] = args.max_live_agents
    if args.revival_cap is not None:
        extra["max_concurrent_revivals"] = args.revival_cap
    try:
        return RuntimeConfig(
            hibernate_after=hibernate_after,
            evict_after=evict_after,
            sweep_interval=max(0.05, min(1.0, hibernate_after / 8)),
            **extra,
        )
    except ConfigError as exc:
        option = {"evict_after": "--evict-after", "hibernate_after": "--hibernate-after"}.get(
            exc.field, exc.field
        )
        reason = str(exc).removeprefix(f"{exc.field}: ")
        raise CliError(f"{option}: {reason}") from None


async def _load(args: argparse.Namespace, url: str, config: RuntimeConfig,
                bar: Bar) -> dict[str, Any]:
    phases = Phases(args.timeout or default_timeout(args.duration))
    run_id = secrets.token_hex(3)
    ids = tuple(f"lt-{run_id}-{i:06d}" for i in range(args.agents))
    started = time.perf_counter()
    build = None
    async with phases.bound():
        with phases.timed("history"):
            bar.phase("history", args.agents)
            build = await build_history(url, ids, args.history, on_conversation=bar.advance,
                                        seed=args.seed)
            bar.done()
    result = None
    if not phases.timed_out:
        plan = RunPlan(
            url=url, conversation_ids=ids, active_ratio=args.active_ratio,
            duration=args.duration, config=config, wake_rate=args.wake_rate,
            think_time=args.think_time, probe_agents=args.probe_agents, seed=args.seed,
        )
        result = await run_phases(plan, bar, phases)
    return {
        "command": "loadtest",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {
            "agents": args.agents,
            "history": args.history,
            "active_ratio": args.active_ratio,
            "duration": args.duration,
            "timeout": phases.timeout,
            "db": display_url(url) if args.db else "temporary SQLite file",
            "hibernate_after": config.hibernate_after,
            "evict_after": config.evict_after,
            "sweep_interval": config.sweep_every,
            "max_live_agents": config.max_live_agents,
            "max_concurrent_revivals": config.max_concurrent_revivals,
            "wake_rate": args.wake_rate,
            "think_time": args.think_time,
            "seed": args.seed,
        },
        **phases.report(),
        "build": to_jsonable(build),
        **to_jsonable(result if result is not None else RunResult()),
        "total_seconds": round(time.perf_counter() - started, 3),
    }


def run(args: argparse.Namespace) -> int:
    if args.url:
        from torpor.cli.loadtest_http import run_http

        return run_http(args)
    config = _runtime_config(args)
    if args.plot:
        check_plot_available()
    out, err = consoles(args.json)
    err.print(plan_line(args, f"history ({args.agents:,} x {args.history:,} events), "
                              f"activate ({args.agents:,} agents, one turn each), "), markup=False)
    workdir: Path | None = None
    if args.db:
        url = args.db
    else:
        workdir = Path(tempfile.mkdtemp(prefix="torpor-loadtest-"))
        url = f"sqlite:///{workdir / 'loadtest.db'}"
    try:
        with Bar(err) as bar:
            report = asyncio.run(_load(args, url, config, bar))
    finally:
        if workdir is not None:
            if args.keep_db:
                err.print(f"database kept at {workdir / 'loadtest.db'}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    print_summary(out, report)
    if args.plot and report["timeline"]:
        plot_timeline(args.plot, report["timeline"],
                      f"{args.agents:,} agents, {args.active_ratio:.0%} driven")
    if args.json:
        write_json(args.json, report)
    if report["timed_out"]:
        err.print(timed_out_line(report), markup=False)
        return 1
    return 0
