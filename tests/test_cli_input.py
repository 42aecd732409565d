"""The command line refuses text the log cannot hold, one line at a time, and goes on.

Subprocesses fed raw bytes: a terminal or pipe that is not UTF-8 reaches
Python as undecodable bytes (stdin) or surrogate-escaped text (argv), and only
a real process shows how the command reacts to them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torpor(*args: str | bytes, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120", "PYTHONUTF8": "1"}
    env.pop("TORPOR_DEBUG", None)
    env.pop("TORPOR_DB", None)
    return subprocess.run(
        [sys.executable, "-m", "torpor", *args],
        input=stdin, capture_output=True, cwd=ROOT, env=env, timeout=60, check=False,
    )


def user_texts(db: str, conversation: str) -> list[str]:
    result = torpor("inspect", "--db", db, conversation, "--json", "-", "--events", "50")
    assert result.returncode == 0, result.stderr
    events = json.loads(result.stdout)["last_events"]
    return [e["body"]["text"] for e in events if e["kind"] == "user"]


def test_chat_refuses_a_bad_line_and_answers_the_good_ones(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'chat.db'}"
    stdin = b"hello\n\xff\xfe not utf-8\nworld\nnul \x00 inside\ncaf\xc3\xa9 ok\n"
    result = torpor("chat", "--db", db, "-c", "demo", stdin=stdin)
    assert result.returncode == 0, result.stderr
    assert result.stderr == b""
    out = result.stdout.decode()
    assert "echo: hello" in out and "echo: world" in out and "echo: café ok" in out
    refusals = [line for line in out.splitlines() if line.startswith("[refused")]
    assert refusals == [
        "[refused input line 2: it is not valid UTF-8 (byte 0xff at offset 0); "
        "nothing was sent]",
        "[refused input line 4: it contains NUL at index 4, which the log cannot hold; "
        "nothing was sent]",
    ]
    # The log holds the good lines, in order, and nothing of the refused ones.
    assert user_texts(db, "demo") == ["hello", "world", "café ok"]


def test_a_bad_line_while_answering_an_approval_asks_again(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'chat.db'}"
    result = torpor("chat", "--db", db, "-c", "demo", stdin=b"!approve deploy\n\xc3\nyes\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout.decode()
    assert "[refused input line 2: it is not valid UTF-8" in out
    assert "echo: approve returned yes" in out


def test_a_conversation_id_that_is_not_utf8_is_one_line_and_exit_2(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'chat.db'}"
    for args in (["chat", "--db", db, "-c", b"caf\xe9"],
                 ["chat", "--db", db, "--conversation", b"\xff"],
                 ["inspect", "--db", db, b"caf\xe9"]):
        result = torpor(*args, stdin=b"hello\n")
        assert result.returncode == 2, result
        lines = result.stderr.decode().splitlines()
        assert len(lines) == 1 and "is not valid UTF-8" in lines[0], lines
        assert result.stdout == b""
    assert not (tmp_path / "chat.db").exists()  # refused before anything was opened


def test_chat_logs_go_to_stderr_only_when_asked(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'chat.db'}"
    quiet = torpor("chat", "--db", db, stdin=b"hi\n")
    assert quiet.returncode == 0 and quiet.stderr == b""
    loud = torpor("-vv", "chat", "--db", db, stdin=b"hi\n")
    assert loud.returncode == 0
    assert b"torpor: DEBUG torpor." in loud.stderr  # one formatted line per record
    assert b"torpor: INFO torpor.store.sqlite.store: " in loud.stderr
    assert b"echo: hi" in loud.stdout and b"DEBUG" not in loud.stdout
