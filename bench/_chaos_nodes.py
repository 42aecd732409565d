"""The processes of a chaos run: ``torpor serve --node-id`` nodes on one throwaway PostgreSQL.

A node keeps its name and port across restarts (a restarted node comes back at the
same address under the same id, with a new incarnation). Faults are real: SIGKILL,
SIGSTOP/SIGCONT, SIGTERM (a graceful leave), ``pg_ctl stop``/``start``/``restart``.
Used by ``bench/cluster_chaos.py`` and ``tests/test_cluster_chaos_liveness.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pg_cluster import PgCluster

from torpor.serve.client import Client

__all__ = ["ADMIN", "TOKEN", "Node", "Nodes"]

TOKEN = "chaos-token"
ADMIN = "chaos-admin"
_ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Node:
    """One node id; ``proc`` is its current process (replaced on a restart)."""

    name: str
    port: int
    log: Path
    proc: asyncio.subprocess.Process | None = None
    state: str = "new"  # up | stopped (SIGSTOP) | killed | left (SIGTERM) | new
    starts: int = 0
    drain: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def client(self) -> Client:
        return Client(f"http://{self.address}", TOKEN)

    @property
    def up(self) -> bool:
        return self.state == "up"


class Nodes:
    """The nodes of one run, and the PostgreSQL cluster under them."""

    def __init__(self, pg: PgCluster, db: str, logs: Path, *, ttl: float, shards: int,
                 model_delay: float, grace: float, fsync: bool) -> None:
        self.pg = pg
        self.db = db
        self.logs = logs
        self.ttl = ttl
        self.shards = shards
        self.model_delay = model_delay
        self.grace = grace
        self.fsync = fsync
        self.by_name: dict[str, Node] = {}

    def live(self) -> set[str]:
        return {n.name for n in self.by_name.values() if n.up}

    def running(self) -> list[Node]:
        """Nodes with a process (up or stopped)."""
        return [n for n in self.by_name.values() if n.state in ("up", "stopped")]

    async def start(self, name: str) -> Node:
        """Start ``name`` (again): returns once it listens."""
        node = self.by_name.get(name)
        if node is None:
            node = self.by_name[name] = Node(name, _free_port(), self.logs / f"{name}.log")
        node.starts += 1
        with node.log.open("ab") as err:
            err.write(f"--- start {node.starts} ---\n".encode())
            err.flush()
            node.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "torpor", "serve", "--db", self.db,
                "--port", str(node.port), "--model", "echo",
                "--model-delay", str(self.model_delay), "--node-id", name,
                "--lease-ttl", str(self.ttl), "--shards", str(self.shards),
                "--token", TOKEN, "--admin-token", ADMIN, "--log-level", "warning",
                "--shutdown-grace", str(self.grace),
                stdout=asyncio.subprocess.PIPE, stderr=err, cwd=_ROOT,
                env={**os.environ, "PYTHONPATH": str(_ROOT)},
            )
        stdout = node.proc.stdout
        assert stdout is not None
        async with asyncio.timeout(120):
            while True:
                line = (await stdout.readline()).decode()
                if not line:
                    tail = node.log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"node {name} exited before listening: {tail}")
                if line.startswith("torpor serve: listening on "):
                    break
        node.drain = asyncio.ensure_future(_drain(stdout))  # a full pipe would block it
        node.state = "up"
        return node

    async def kill(self, name: str) -> None:
        node = self.by_name[name]
        assert node.proc is not None
        node.proc.kill()
        node.state = "killed"
        await node.proc.wait()

    def pause(self, name: str) -> None:
        node = self.by_name[name]
        assert node.proc is not None
        os.kill(node.proc.pid, signal.SIGSTOP)
        node.state = "stopped"

    def resume(self, name: str) -> None:
        node = self.by_name[name]
        assert node.proc is not None
        os.kill(node.proc.pid, signal.SIGCONT)
        node.state = "up"

    async def leave(self, name: str) -> float:
        """SIGTERM (a graceful leave); seconds until the process exited."""
        node = self.by_name[name]
        assert node.proc is not None
        started = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        node.state = "left"
        async with asyncio.timeout(self.grace + 60):
            await node.proc.wait()
        return time.monotonic() - started

    async def close(self) -> None:
        for node in self.by_name.values():
            if node.proc is not None and node.proc.returncode is None:
                if node.state == "stopped":
                    os.kill(node.proc.pid, signal.SIGCONT)
                node.proc.send_signal(signal.SIGTERM)
        for node in self.by_name.values():
            if node.proc is None:
                continue
            try:
                async with asyncio.timeout(self.grace + 30):
                    await node.proc.wait()
            except TimeoutError:
                node.proc.kill()
                await node.proc.wait()
            if node.drain is not None:
                node.drain.cancel()

    async def admin_view(self, node: Node) -> dict[str, Any] | None:
        """GET /admin/cluster of an up node (None: it did not answer within 3 s)."""
        if not node.up:
            return None
        try:
            async with asyncio.timeout(3):
                view: dict[str, Any] = await node.client.call("GET", "/admin/cluster",
                                                              token=ADMIN)
            return view
        except Exception:  # any failure is "no view": the caller retries or reports it
            return None

    def log_errors(self) -> dict[str, dict[str, Any]]:
        """Per node log: records at error level or above by event, and tracebacks."""
        out: dict[str, dict[str, Any]] = {}
        for node in self.by_name.values():
            text = node.log.read_text(errors="replace") if node.log.exists() else ""
            events: dict[str, int] = {}
            for line in text.splitlines():
                if not line.startswith("{"):
                    continue
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if record.get("level") in ("error", "critical"):
                        name = str(record.get("event", ""))[:80]
                        events[name] = events.get(name, 0) + 1
            out[node.name] = {"error_records": events,
                              "tracebacks": text.count("Traceback (most recent call last)")}
        return out

    # -- PostgreSQL ---------------------------------------------------------------------
    async def pg_stop(self) -> None:
        await asyncio.to_thread(self.pg.run, "pg_ctl", "stop", "-w", "-t", "60", "-m", "fast",
                                "-D", str(self.pg.data))

    async def pg_start(self) -> None:
        await asyncio.to_thread(self.pg.start, fsync=self.fsync)

    async def pg_restart(self) -> None:
        # -l: without it the server's output would go to pg_ctl's pipe, held open for ever.
        await asyncio.to_thread(self.pg.run, "pg_ctl", "restart", "-w", "-t", "60", "-m",
                                "fast", "-D", str(self.pg.data), "-l",
                                str(self.pg.root / "server.log"))


async def _drain(stream: asyncio.StreamReader) -> None:
    with contextlib.suppress(Exception):
        while await stream.read(65536):
            pass
