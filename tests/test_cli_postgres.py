"""Every command takes a ``postgresql://`` URL: loadtest, chat and inspect against a real server.

Runs against the throwaway cluster of ``pg_cluster`` (skipped, with the
reason, only when this machine has no PostgreSQL binaries); every test gets a
fresh database. Each command runs in a subprocess, as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

asyncpg = pytest.importorskip("asyncpg")

from pg_cluster import PgCluster, pg_cluster  # noqa: E402, F401 - the session fixture

ROOT = Path(__file__).resolve().parents[1]


def torpor(*args: str, stdin: str = "", prelude: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    env.pop("TORPOR_DEBUG", None)
    env.pop("TORPOR_DB", None)
    code = f"{prelude}\nimport sys\nfrom torpor.cli import main\nsys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        input=stdin, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
        check=False,
    )


@pytest.fixture
async def pg_url(pg_cluster: PgCluster) -> str:  # noqa: F811
    name = "cli_" + uuid.uuid4().hex[:16]
    admin = await asyncpg.connect(pg_cluster.url())
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return pg_cluster.url(name)


def test_loadtest_chat_and_inspect_on_postgresql(pg_url: str) -> None:
    load = torpor("loadtest", "-n", "20", "-m", "4", "-d", "0.3", "--probe-agents", "0",
                  "--db", pg_url, "--json", "-")
    assert load.returncode == 0, load.stderr
    report = json.loads(load.stdout)
    assert report["config"]["db"] == pg_url
    assert report["build"]["conversations"] == 20 and report["build"]["events"] == 80
    assert report["activation"]["errors"] == 0 and report["run"]["errors"] == {}

    chat = torpor("chat", "--db", pg_url, "-c", "demo", stdin="hello there\n!approve ship\n")
    assert chat.returncode == 0, chat.stderr
    assert "echo: hello there" in chat.stdout and "[suspended] waiting for" in chat.stdout

    listing = torpor("inspect", "--db", pg_url, "--json", "-", "--limit", "0")
    assert listing.returncode == 0, listing.stderr
    data = json.loads(listing.stdout)
    assert data["conversations"] == 21
    assert "demo" in {c["conversation_id"] for c in data["shown"]}

    detail = torpor("inspect", "--db", pg_url, "demo", "--json", "-")
    assert detail.returncode == 0, detail.stderr
    state = json.loads(detail.stdout)["state"]
    assert state["state"] == "suspended" and len(state["pending_calls"]) == 1

    # A second chat session answers the approval left pending, on the same server.
    again = torpor("chat", "--db", pg_url, "-c", "demo", stdin="approved\n")
    assert again.returncode == 0, again.stderr
    assert "echo: approve returned approved" in again.stdout


def test_postgres_scheme_alias_and_missing_conversation(pg_url: str) -> None:
    alias = "postgres://" + pg_url.removeprefix("postgresql://")
    chat = torpor("chat", "--db", alias, "-c", "c1", stdin="hi\n")
    assert chat.returncode == 0, chat.stderr
    missing = torpor("inspect", "--db", pg_url, "nobody")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == ["torpor: error: unknown conversation: nobody"]


def test_inspect_does_not_create_a_store_in_an_empty_database(pg_url: str) -> None:
    result = torpor("inspect", "--db", pg_url)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"torpor: error: {pg_url}: no torpor store in this database"
    ]


def test_an_unreachable_server_is_one_line_without_the_password(pg_cluster: PgCluster) -> None:  # noqa: F811
    url = f"postgresql://torpor:secret@127.0.0.1:{pg_cluster.port}/no_such_database"
    for args in (["inspect", "--db", url], ["chat", "--db", url]):
        result = torpor(*args, stdin="hi\n")
        assert result.returncode == 1, result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "no_such_database" in lines[0], lines
        assert "secret" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["loadtest", "chat", "inspect"])
def test_without_asyncpg_the_error_names_the_extra(command: str) -> None:
    url = "postgresql://someone:secret@127.0.0.1:1/db"
    result = torpor(command, "--db", url, prelude="import sys; sys.modules['asyncpg'] = None")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'torpor[postgres]'" in lines[0], lines
    assert "secret" not in result.stderr
