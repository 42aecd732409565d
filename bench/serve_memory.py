"""What one idle follower holds in ``torpor serve``: tracemalloc, allocation site by site.

bench/serve.py gives the RSS growth per idle follower; this says where it goes. A
``torpor serve`` process (``--model echo``, the log at ``warning``) runs with tracemalloc
on; this script opens ``--followers`` idle SSE GETs of as many conversations (connected
a few hundred at a time, then every GET at once, as bench/serve.py does; ``--batch``: a
few hundred GETs at a time), and the server compares a snapshot taken before them with
one taken after them: the Python memory per follower, by allocation line (``--group
lineno``) or by stack (``--group traceback``), largest first, and the peak while they
opened. RSS also counts what the burst freed but the allocator keeps (see
``sys._debugmallocstats``); memory outside Python's allocator (the kernel's socket
buffers, the C parts of uvloop or httptools) is not seen here.

Usage: ``python bench/serve_memory.py [--followers 2000] [--top 30] [--group lineno]
[--batch] [--loop asyncio|uvloop] [--http h11|httptools]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

TOKEN = os.environ.get("TORPOR_MEMORY_TOKEN") or "mem-" + secrets.token_hex(6)


def _server(args: argparse.Namespace) -> int:
    """The server side: torpor serve under tracemalloc; SIGUSR1 takes the baseline,
    SIGUSR2 writes the comparison to ``args.report``."""
    tracemalloc.start(args.frames)
    snapshots: dict[str, Any] = {}

    def snap() -> tracemalloc.Snapshot:
        gc.collect()
        return tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)])

    def before(signum: int, frame: Any) -> None:
        snapshots["before"] = snap()
        snapshots["traced"] = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()

    def after(signum: int, frame: Any) -> None:
        peak = tracemalloc.get_traced_memory()[1] - snapshots["traced"]
        stats = snap().compare_to(snapshots["before"], args.group)
        n = args.followers
        total = sum(s.size_diff for s in stats)
        lines = [f"python memory per follower: {total / n:,.0f} B over {n} followers "
                 f"(grouped by {args.group}); at the peak while they opened: {peak / n:,.0f} B"]
        for s in stats[:args.top]:
            if s.size_diff <= 0:
                continue
            lines.append(f"{s.size_diff / n:8,.0f} B {s.count_diff / n:6.2f} blocks")
            shown = s.traceback.format(limit=args.depth, most_recent_first=True)
            lines += ["      " + line.strip() for line in shown if line.strip()
                      and not line.strip().startswith(("File \"<", "^"))][: 2 * args.depth]
        Path(args.report).write_text("\n".join(lines) + "\n")

    signal.signal(signal.SIGUSR1, before)
    signal.signal(signal.SIGUSR2, after)
    from torpor.cli import main

    return main(["serve", "--db", f"sqlite:///{args.db}", "--port", "0", "--model", "echo",
                 "--token", TOKEN, "--log-level", "warning", "--loop", args.loop,
                 "--http", args.http])


async def _client(args: argparse.Namespace, process: subprocess.Popen[str],
                  host: str, port: int, report: Path) -> None:
    from _serve_client import open_conn

    async def followers(count: int, tag: str) -> list[Any]:
        # as bench/serve.py does: connect them all (a few hundred at a time), then every
        # follower's GET at once (--batch: a few hundred GETs at a time)
        conns: list[Any] = []
        for start in range(0, count, 200):
            conns += await asyncio.gather(*(open_conn(host, port, TOKEN)
                                            for _ in range(start, min(count, start + 200))))
        step = 200 if args.batch else count
        for start in range(0, count, step):
            statuses = await asyncio.gather(*(
                c.follow(f"/v1/conversations/{tag}-{start + i}/stream")
                for i, c in enumerate(conns[start:start + step])))
            assert all(s == 200 for s in statuses), statuses
        return conns

    for c in await followers(50, "warm"):  # one-off allocations out of the baseline
        c.abort()
    await asyncio.sleep(1.0)  # a measurement, not a test: let the server see the aborts
    process.send_signal(signal.SIGUSR1)
    await asyncio.sleep(1.0 + args.followers / 2000)
    conns = await followers(args.followers, "f")
    await asyncio.sleep(1.0)
    process.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 900
    while not _written(report):
        assert time.monotonic() < deadline, "no report from the server"
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)
    for c in conns:
        c.abort()


def _written(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 0


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--followers", type=int, default=2000)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--depth", type=int, default=4, help="frames shown per entry")
    parser.add_argument("--frames", type=int, default=12, help="frames tracemalloc keeps")
    parser.add_argument("--group", choices=("lineno", "traceback", "filename"),
                        default="lineno")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--http", choices=("h11", "httptools"), default="h11")
    parser.add_argument("--batch", action="store_true",
                        help="open the followers a few hundred at a time, not all at once")
    parser.add_argument("--server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.server:
        return _server(args)
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.followers + 1024)),
                                                hard))
    with tempfile.TemporaryDirectory(prefix="torpor-serve-memory-") as tmp:
        report = Path(tmp) / "report.txt"
        env = {**os.environ, "TORPOR_MEMORY_TOKEN": TOKEN, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        process = subprocess.Popen(
            [sys.executable, __file__, "--server", "--db", str(Path(tmp) / "m.db"),
             "--report", str(report), "--followers", str(args.followers),
             "--top", str(args.top), "--depth", str(args.depth), "--frames", str(args.frames),
             "--group", args.group, "--loop", args.loop, "--http", args.http],
            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )
        try:
            assert process.stdout is not None
            first = process.stdout.readline()
            if "listening on " not in first:
                raise RuntimeError(f"the server did not start: {first!r}")
            address = first.split("listening on http://", 1)[1].split("/", 1)[0]
            host, _, port = address.rpartition(":")
            asyncio.run(_client(args, process, host.strip("[]"), int(port), report))
            print(report.read_text(), end="")
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
