"""The ``torpor`` command end to end: each subcommand in a subprocess on a temp database.

Subprocesses on purpose: the exit code, what reaches stdout and stderr, and the
absence of tracebacks are the contract, and only a real process shows them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torpor(
    *args: str, stdin: str | None = None, timeout: float = 60, columns: int = 120
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORPOR_DB": "sqlite://",
           "COLUMNS": str(columns)}
    env.pop("TORPOR_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "torpor", *args],
        input=stdin if stdin is not None else "",
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout, check=False,
    )


def db_url(path: Path) -> str:
    return f"sqlite:///{path}"


def test_loadtest_small_run_writes_every_figure_as_json(tmp_path: Path) -> None:
    plot = tmp_path / "timeline.png"
    result = torpor("loadtest", "--agents", "60", "--history", "5", "--active-ratio", "0.2",
                    "--duration", "0.6", "--probe-agents", "10", "--wake-rate", "20",
                    "--json", "-", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # stdout is JSON only; the table went to stderr
    assert report["config"]["agents"] == 60 and report["config"]["history"] == 5
    assert report["build"]["events"] == 300
    assert report["activation"]["agents"] == 60 and report["activation"]["errors"] == 0
    assert report["run"]["driven_agents"] == 12 and report["run"]["turns"] > 0
    assert report["run"]["errors"] == {}
    assert report["lifecycle"]["activations"] >= 60
    assert report["memory"]["probe_agents"] == 10
    # How long each phase took: --duration is the run's alone, the rest comes on top.
    assert report["timed_out"] is False and report["timeout"] == 120 + 2 * 0.6
    phases = report["phases"]
    assert [p["name"] for p in phases] == ["history", "activate", "run", "probe", "close"]
    assert all(p["completed"] and p["seconds"] >= 0 and p["cpu_seconds"] >= 0 for p in phases)
    assert "phases (wall clock)" in result.stderr
    assert report["memory"]["probe_hibernated_traced_bytes_per_agent"] < (
        report["memory"]["probe_active_traced_bytes_per_agent"]
    )
    timeline = report["timeline"]
    assert timeline and {"activate", "run"} <= {s["phase"] for s in timeline}
    assert all(s["with_working_set"] + s["hibernated"] + s["evicted"] >= 0 for s in timeline)
    assert "torpor loadtest" in result.stderr  # the summary table, for people
    # Revival rows say they include queueing; the end-of-run one only when it differs.
    assert "revival slots included" in " ".join(result.stderr.split())  # however wrapped
    assert report["activation"]["revivals"] <= report["lifecycle"]["revivals"]
    same = all(report["activation"][k] == report["lifecycle"][k]
               for k in ("revival_p50_ms", "revival_p99_ms"))
    assert ("revival p50/p99 (end of run)" in result.stderr) is not same
    assert "last 4,096" not in result.stderr
    if plot.exists():
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loadtest_timeout_cuts_the_phase_under_way_and_says_which() -> None:
    """A two-minute run under a 2 s bound: the phase under way is cut, the runtime still
    closes, and the report (written, exit 1) lists the phases that ran. Without the bound
    the run outlasts the helper's 60 s and the test fails."""
    result = torpor("loadtest", "-n", "20", "-m", "4", "-d", "120", "--timeout", "2",
                    "--probe-agents", "5", "--json", "-")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["timed_out"] is True and report["timeout"] == 2
    phases = report["phases"]
    names = [p["name"] for p in phases]
    cut = [p["name"] for p in phases if not p["completed"]]
    assert len(cut) == 1 and cut[0] in ("history", "activate", "run")  # whichever 2 s reached
    assert "probe" not in names  # never started
    assert all(p["completed"] for p in phases[:names.index(cut[0])])
    if cut[0] != "history":  # a runtime ran: it closed after the cut, ending what was cut
        assert names[-1] == "close" and phases[-1]["completed"]
    if cut[0] == "run":  # a cut run still reports what it did so far
        assert report["run"]["driven_agents"] == 2 and report["lifecycle"] is None
    assert all(isinstance(p["seconds"], float) for p in phases)
    assert f"during the {cut[0]} phase" in " ".join(result.stderr.split())
    assert "TIMED OUT" in result.stderr and "Traceback" not in result.stderr


def test_loadtest_on_a_given_db_keeps_it_and_prints_a_table(tmp_path: Path) -> None:
    db = tmp_path / "load.db"
    out = tmp_path / "load.json"
    result = torpor("loadtest", "-n", "20", "-m", "4", "-d", "0.3", "--probe-agents", "0",
                    "--db", db_url(db), "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "turns/s" in result.stdout
    assert db.exists()
    report = json.loads(out.read_text())
    assert report["build"]["conversations"] == 20
    assert "probe_agents" not in report["memory"]
    listing = torpor("inspect", "--db", db_url(db), "--json", "-", "--limit", "5")
    assert listing.returncode == 0, listing.stderr
    data = json.loads(listing.stdout)
    assert data["conversations"] == 20 and len(data["shown"]) == 5
    assert data["events"] >= 20 * 4


def test_chat_streams_tools_and_suspension_then_inspect_reads_the_log(tmp_path: Path) -> None:
    db = db_url(tmp_path / "chat.db")
    script = "hello there\n!clock\n!approve deploy\nyes\n/history 3\n/recall deploy\n/inspect\n"
    first = torpor("chat", "--db", db, "-c", "demo", stdin=script + "!approve again\n")
    assert first.returncode == 0, first.stderr
    out = first.stdout
    assert "echo: hello there" in out
    assert "[tool call] clock({})" in out and "[tool result] clock:" in out
    assert "[suspended] waiting for approve-" in out
    assert "echo: approve returned yes" in out
    assert "turn 3" in out  # /history lines
    assert "score" in out  # /recall hits
    assert "awaiting_input" in out  # /inspect table
    assert "stays suspended" in out  # input ended while the last approval was pending

    detail = torpor("inspect", "--db", db, "demo", "--json", "-")
    assert detail.returncode == 0, detail.stderr
    data = json.loads(detail.stdout)
    assert data["state"]["state"] == "suspended"
    assert len(data["state"]["pending_calls"]) == 1
    assert data["model_calls"] and data["anatomy"]["sections"]
    assert data["anatomy"]["events_in_context"] >= 1 and data["anatomy"]["markers"] == 0
    assert len(data["anatomy"]["turn_id"]) == 26 and "topic_changed" in data["anatomy"]
    shown = torpor("inspect", "--db", db, "demo")
    assert shown.returncode == 0, shown.stderr
    assert "in context:" in shown.stdout and "turn id:" in shown.stdout
    assert data["last_events"][-1]["kind"] == "suspended"

    second = torpor("chat", "--db", db, "-c", "demo", stdin="approved later\n/quit\n")
    assert second.returncode == 0, second.stderr
    assert "echo: approve returned approved later" in second.stdout
    after = json.loads(torpor("inspect", "--db", db, "demo", "--json", "-").stdout)
    assert after["state"]["state"] == "awaiting_input"


@pytest.mark.parametrize(
    "args",
    [
        ["loadtest", "--agents", "0"],
        ["loadtest", "--active-ratio", "1.5"],
        ["loadtest", "--duration", "soon"],
        ["loadtest", "--timeout", "0"],
        ["loadtest", "--db", "sqlite:////no/such/dir/x.db"],
        ["loadtest", "--hibernate-after", "5", "--evict-after", "1"],
        ["inspect", "--db", "sqlite:////no/such/file.db"],
        ["inspect", "--db", "mysql://x"],
        ["chat", "--db", "ftp://x"],
        ["frobnicate"],
        [],
    ],
)
def test_bad_arguments_get_one_line_and_exit_2(args: list[str]) -> None:
    result = torpor(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_inspect_of_a_missing_conversation_is_one_line(tmp_path: Path) -> None:
    db = db_url(tmp_path / "c.db")
    assert torpor("chat", "--db", db, stdin="hi\n").returncode == 0
    result = torpor("inspect", "--db", db, "nobody")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["torpor: error: unknown conversation: nobody"]


async def test_inspect_lists_the_anatomy_in_the_order_the_context_is_sent(
    tmp_path: Path,
) -> None:
    from torpor import Runtime

    db = db_url(tmp_path / "card.db")
    async with Runtime(db) as rt:  # a task card: a head block besides the markers
        await rt.task("c").update(goal="ship the fix")
        await (await rt.send("c", "hello")).result()
        recorded = list((await rt.store.model_calls("c", limit=1))[-1].sections)
    sent = ["system", "task_card", "markers", "tools", "tail", "tool_results", "user"]
    assert sorted(recorded) == sorted(sent) and recorded != sent  # recorded in another order
    data = json.loads(torpor("inspect", "--db", db, "c", "--json", "-").stdout)
    assert list(data["anatomy"]["sections"]) == sent
    table = torpor("inspect", "--db", db, "c").stdout
    rows = [line.split()[1] for line in table.splitlines()
            if len(line.split()) > 2 and line.split()[1] in sent]
    assert rows == sent


async def test_inspect_shows_every_table_header_whole_at_80_columns(tmp_path: Path) -> None:
    from torpor import AgentConfig, ModelSummarizer, Runtime, ScriptedModel

    db = db_url(tmp_path / "fold.db")
    summarizer = ModelSummarizer(ScriptedModel.replies("EPISODE:\nearlier\nITEMS:\n[]",
                                                       loop=True))
    agent = AgentConfig(model=ScriptedModel.replies("ok", loop=True), summarizer=summarizer,
                        working_budget=150, tail_turns=1, context_window=4_000,
                        max_output_tokens=500, safety_margin=100, recall_tools=False)
    async with Runtime(db, agent=agent) as rt:  # folds: a summary call among the turn calls
        for i in range(6):
            await (await rt.send("c", f"message {i} " + "words " * 30)).result()
    out = torpor("inspect", "--db", db, "c", "--calls", "20", columns=80).stdout
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    starts = [i for i, line in enumerate(lines) if line.startswith("┏")]
    headers = [lines[i + 1:lines.index(lines[i].replace("┏", "┡").replace("┳", "╇")
                                       .replace("┓", "┩"), i)] for i in starts]
    assert headers and not any("…" in line for header in headers for line in header)
    calls = next(h for h in headers if any("budget" in line for line in h))
    assert calls[0].replace("┃", " ").split() == [
        "turn", "call", "cycle", "prompt", "cached", "budget", "ms", "error"
    ]  # one line of whole words
    assert any("1 summary" in line for line in lines)  # the purpose is not cut either
