"""Shared plumbing for the benchmarks: output (table + JSON), memory readings, subprocesses.

Every benchmark prints a short table for people and one JSON document for
machines (``--json FILE`` also writes it to a file), and states the machine
it ran on. Scenarios whose memory is compared run in fresh subprocesses, so
one scenario's heap does not inflate the next one's RSS.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/x.py` from a checkout
    sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from torpor.cli.common import machine  # noqa: E402
from torpor.cli.memory import peak_rss_bytes, rss_bytes, settle  # noqa: E402

__all__ = [
    "LOAD_AT_START",
    "ROOT",
    "conditions",
    "emit",
    "fresh_db",
    "machine",
    "peak_rss_bytes",
    "quiet",
    "ratio",
    "rss_bytes",
    "run_json",
    "settle",
    "table",
]


LOAD_AT_START = os.getloadavg()
"""The host's load average (1, 5, 15 min) as this process started, before it added its own."""


def _gauge_work() -> int:
    # Dicts, small strings, tuples, calls and a sort: the kind of work a torpor turn is made of.
    table: dict[str, tuple[int, str]] = {}
    for i in range(50_000):
        key = f"k{i % 5000}-{i}"
        table[key] = (i, key.upper())
    return len(sorted(table.items(), key=lambda kv: kv[1][0] % 977))


def host_gauge_ms(runs: int = 7) -> float:
    """CPU ms of a fixed pure-Python workload, the fastest of ``runs``: how fast this host is.

    The same code doing the same work took 1.5-1.7x the CPU on one host of this workplace
    as on another (bench/RESULTS.md); published µs are only comparable at a similar gauge.
    CPU time, not wall time, so other processes' load does not count (beyond what they
    take from the core's caches).
    """
    best = float("inf")
    for _ in range(runs):
        t0 = time.process_time()
        _gauge_work()
        best = min(best, time.process_time() - t0)
    return round(best * 1000, 1)


def conditions() -> dict[str, Any]:
    """What a figure ran under: the load before and after, and the host's speed."""
    return {"load_average_at_start": [round(x, 2) for x in LOAD_AT_START],
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "host_gauge_ms": host_gauge_ms()}


def quiet() -> None:
    """No library logs in benchmark output (errors still show)."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def fresh_db(directory: Path, name: str) -> str:
    """A store URL for a new SQLite file in ``directory`` (left-overs removed)."""
    path = directory / name
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return f"sqlite:///{path}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 2)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    t = Table(title=title)
    for i, name in enumerate(columns):
        t.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*("-" if v is None else f"{v:,}" if isinstance(v, int) else
                    f"{v:,.2f}" if isinstance(v, float) else str(v) for v in row))
    return t


def emit(data: dict[str, Any], tables: Sequence[Table], json_target: str | None) -> None:
    """Tables to stderr when JSON goes to stdout (``--json -``), else to stdout; then JSON."""
    data = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "conditions": conditions(), **data}
    people = Console(stderr=json_target == "-", highlight=False, width=110)
    for t in tables:
        people.print(t)
    text = json.dumps(data, indent=None if json_target != "-" else 2, default=str)
    if json_target == "-":
        sys.stdout.write(text + "\n")
        return
    if json_target:
        Path(json_target).write_text(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.write(text + "\n")


def run_json(args: Sequence[str], timeout: float = 900) -> dict[str, Any]:
    """Run ``python ARGS --json FILE`` in a fresh process; its JSON document."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        target = handle.name
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(
            [sys.executable, *args, "--json", target],
            capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, check=False,
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}: {' | '.join(tail)}")
        result: dict[str, Any] = json.loads(Path(target).read_text())
        return result
    finally:
        Path(target).unlink(missing_ok=True)
