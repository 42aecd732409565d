"""A throwaway PostgreSQL cluster built from the machine's own binaries.

Why: the PostgreSQL store must be tested against a real server, and a test run
must not depend on (or disturb) a server someone else runs. ``initdb`` makes a
fresh cluster in a temporary directory; it listens on a free loopback port and
on a Unix socket inside that directory, with ``trust`` authentication, and is
stopped and deleted afterwards.

PostgreSQL refuses to run as root. When the tests run as root, ``initdb`` and
the server run as an unprivileged account instead: ``postgres`` if the machine
has one, else ``nobody`` (the temporary directory is handed to that account).

Used by the session fixture ``pg_cluster`` (tests) and by ``bench/store_postgres.py``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = [
    "ClusterUnavailable",
    "PgCluster",
    "find_bindir",
    "fresh_schema",
    "pg_cluster",
    "running_cluster",
]

SUPERUSER = "torpor"
_TOOLS = ("initdb", "pg_ctl", "postgres")


class ClusterUnavailable(RuntimeError):
    """This machine cannot run a throwaway cluster; the message says why."""


def find_bindir() -> Path | None:
    """A directory holding initdb, pg_ctl and postgres: PATH first, then the usual places."""
    found = shutil.which("initdb")
    candidates = [Path(found).resolve().parent] if found else []
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    candidates += [Path("/usr/local/pgsql/bin"), Path("/usr/local/bin")]
    for directory in candidates:
        if all((directory / tool).exists() for tool in _TOOLS):
            return directory
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _service_account() -> pwd.struct_passwd | None:
    """None when we are not root; otherwise the account the server will run as."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise ClusterUnavailable("running as root and there is no 'postgres' or 'nobody' account")


@dataclass
class PgCluster:
    """A running throwaway cluster; ``url(db)`` names one of its databases."""

    root: Path
    bindir: Path
    port: int
    account: pwd.struct_passwd | None

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a PostgreSQL tool as the cluster's owner."""
        command = [str(self.bindir / args[0]), *args[1:]]
        kwargs: dict[str, object] = {}
        if self.account is not None:
            kwargs = {"user": self.account.pw_uid, "group": self.account.pw_gid, "extra_groups": []}
        result = subprocess.run(  # checked below, with the output in the error
            command,
            capture_output=True,
            text=True,
            cwd=self.root,
            env={**os.environ, "LC_ALL": "C", "HOME": str(self.root)},
            timeout=120,
            **kwargs,  # type: ignore[arg-type]
        )
        if check and result.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ClusterUnavailable(
                f"{args[0]} failed ({result.returncode}): {result.stderr.strip()} {tail}"
            )
        return result

    def start(self, *, fsync: bool) -> None:
        options = [
            "-c listen_addresses=127.0.0.1",
            f"-p {self.port}",
            f"-c unix_socket_directories={self.root}",
            "-c max_connections=200",
        ]
        if not fsync:  # tests: durability is not what they check, speed is welcome
            options += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
        self.run(
            "pg_ctl", "start", "-w", "-t", "60", "-D", str(self.data),
            "-l", str(self.root / "server.log"), "-o", " ".join(options),
        )  # fmt: skip

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self.run("pg_ctl", "stop", "-w", "-t", "60", "-m", "fast", "-D", str(self.data),
                     check=False)  # fmt: skip


@contextlib.contextmanager
def running_cluster(*, fsync: bool = False) -> Iterator[PgCluster]:
    """initdb, start, yield, stop, delete. Raises ClusterUnavailable if it cannot."""
    bindir = find_bindir()
    if bindir is None:
        raise ClusterUnavailable(
            "no PostgreSQL binaries (initdb, pg_ctl, postgres) on PATH or under "
            "/usr/lib/postgresql/*/bin"
        )
    account = _service_account()
    root = Path(tempfile.mkdtemp(prefix="torpor-pg-"))
    try:
        if account is not None:
            os.chown(root, account.pw_uid, account.pw_gid)
        cluster = PgCluster(root, bindir, 0, account)
        cluster.run(
            "initdb", "-D", str(cluster.data), "-U", SUPERUSER, "-A", "trust",
            "-E", "UTF8", "--locale=C", "--no-sync",
        )  # fmt: skip
        for attempt in range(3):  # the free port may be taken before the server binds it
            cluster.port = _free_port()
            try:
                cluster.start(fsync=fsync)
                break
            except ClusterUnavailable:
                if attempt == 2:
                    raise
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """One cluster for the whole session; each test makes its own database in it."""
    try:
        manager = running_cluster()
        cluster = manager.__enter__()
    except ClusterUnavailable as exc:
        pytest.skip(f"no throwaway PostgreSQL cluster: {exc}")
    try:
        yield cluster
    finally:
        manager.__exit__(None, None, None)


async def fresh_schema(database: str) -> str:
    """``database``'s URL with a new, empty schema as its ``search_path``: as empty as a
    new database for a store, at a millisecond instead of a few hundred."""
    import uuid

    asyncpg = pytest.importorskip("asyncpg")
    schema = "s_" + uuid.uuid4().hex[:16]
    conn = await asyncpg.connect(database)
    try:
        await conn.execute(f"CREATE SCHEMA {schema}")
    finally:
        await conn.close()
    return f"{database}?search_path={schema}"
