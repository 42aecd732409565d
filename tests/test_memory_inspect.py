"""``torpor inspect`` shows a conversation's derived memory, read from the store alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from torpor import LedgerEntry, Runtime, SemanticItem
from torpor.store.memory import EpisodicItem

ROOT = Path(__file__).resolve().parents[1]


def inspect(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "160"}
    return subprocess.run([sys.executable, "-m", "torpor", "inspect", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=60,
                          check=False)


async def test_inspect_lists_episodes_facts_the_ledger_and_skipped_turns(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    async with Runtime(url) as rt:
        await (await rt.send("c", "hello")).result()
        await rt.store.put_memory(
            "c",
            episodes=[EpisodicItem(2, 0, 1, (1,), "The user greeted.", salience=0.6)],
            facts=[SemanticItem(2, 0, "db", "fact", "postgres 14", confidence=0.9),
                   SemanticItem(2, 1, "db", "decision", "postgres 16", confidence=0.9)],
        )
        await rt.store.put_ledger("c", [LedgerEntry("db", "update", "2.1", ("2.0",), "newer")])
        await rt.store.put_turn_decision("c", 1, "none")
    data = json.loads(inspect("--db", url, "c", "--json", "-").stdout)["memory"]
    assert [e["summary"] for e in data["episodes"]] == ["The user greeted."]
    assert [(f["id"], f["standing"]) for f in data["facts"]] == [("2.0", False), ("2.1", True)]
    assert [(d["key"], d["action"], d["superseded"]) for d in data["ledger"]] == [
        ("db", "update", ["2.0"])]
    assert data["skipped_turns"] == [1]
    assert "- (decision) db: postgres 16" in data["digest"]
    shown = inspect("--db", url, "c")
    assert shown.returncode == 0, shown.stderr
    for text in ("memory: episodes", "The user greeted.", "memory: semantic items",
                 "postgres 16", "memory: ledger", "left out of memory (NONE): 1"):
        assert text in shown.stdout


async def test_inspect_shows_brackets_in_a_models_text_as_they_are(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    async with Runtime(url) as rt:
        await (await rt.send("c", "hello")).result()
        await rt.store.put_memory(
            "c", episodes=[EpisodicItem(2, 0, 1, (1,), "see [red]x[/red]")],
            facts=[SemanticItem(2, 0, "k[/]", "fact", "close [/] tag [bold]b")])
        await rt.store.put_ledger("c", [LedgerEntry("k[/]", "update", "2.0", (), "why [/]")])
    shown = inspect("--db", url, "c")
    assert shown.returncode == 0, shown.stderr
    for text in ("see [red]x[/red]", "k[/]", "close [/] tag [bold]b", "why [/]"):
        assert text in shown.stdout
