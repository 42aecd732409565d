"""``bench/needles.py --table1 --quick``: the end-to-end recall benchmark's structure holds.

Not timing and not the full-size figures (those are the benchmark's to print):
that every method is measured at every level over the same turns, that the
conversations really folded as often as the level says, that push put something
in context within its budget on every call and pulled less, and that what
truncation and narrative compaction lose, torpor still answers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("table1") / "report.json"
    sys.path.insert(0, str(BENCH))  # the benchmarks import their siblings
    try:
        import needles

        needles.main(["--table1", "--quick", "--generator", "today", "--json", str(out)])
    finally:
        sys.path.remove(str(BENCH))
    loaded: dict[str, Any] = json.loads(out.read_text())["today"]
    return loaded


def test_every_method_is_scored_at_every_level_over_the_same_needles(
    report: dict[str, Any],
) -> None:
    assert report["quick"] and report["levels"] == [1, 3]
    asked = report["traces"] * report["needles_per_trace"]
    for level in ("1", "3"):
        row = report["results"][level]
        assert set(row) == {"truncation", "narrative", "pull", "push"}
        for method in row.values():
            assert method["asked"] == asked
            for hops in ("1-hop", "2-hop", "all"):
                assert 0.0 <= method[hops]["mean"] <= 100.0


def test_the_conversations_folded_as_often_as_the_level_says_and_push_saw_the_same_turns(
    report: dict[str, Any],
) -> None:
    for level in ("1", "3"):
        row = report["results"][level]
        for pull, push in zip(row["pull"]["runs"], row["push"]["runs"], strict=True):
            assert pull["cycles_before_questions"] == int(level)
            assert push["flood_turns"] == pull["flood_turns"]
            assert push["cycles_before_questions"] == int(level)


def test_push_stays_within_budget_on_every_call_and_replaces_pulls(
    report: dict[str, Any],
) -> None:
    assert report["targets"]["pushed_within_budget_every_call"]["met"]
    for level in ("1", "3"):
        row = report["results"][level]
        for run in row["push"]["runs"]:
            assert run["calls_with_push"] > 0
            assert 0 < run["recalled_max_tokens"] <= report["push_tokens"]
        assert all(run["calls_with_push"] == 0 for run in row["pull"]["runs"])
        assert row["push"]["pull_pct"] < row["pull"]["pull_pct"]


def test_torpor_answers_what_truncation_and_narrative_compaction_lose(
    report: dict[str, Any],
) -> None:
    row = report["results"]["3"]
    for method in ("pull", "push"):
        assert row[method]["2-hop"]["mean"] > row["truncation"]["2-hop"]["mean"]
        assert row[method]["2-hop"]["mean"] > row["narrative"]["2-hop"]["mean"]
        assert row[method]["false_recall_pct"] <= 2.0
