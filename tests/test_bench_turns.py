"""``bench/turns.py --turns``: a level does a fixed amount of work, the same on any host.

Not timing (the figures are the benchmark's to print): that every conversation takes
exactly the turns asked for, torpor's and the naive floor's alike, so two runs end with
the same tails whatever the host's speed; and that RESULTS.md states what a figure ran
under and shows the instruction counts.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench() -> Iterator[dict[str, ModuleType]]:
    sys.path.insert(0, str(BENCH))  # the benchmarks import their siblings
    try:
        import _report
        import turns

        yield {"turns": turns, "report": _report}
    finally:
        sys.path.remove(str(BENCH))


def test_each_conversation_takes_exactly_the_turns_asked_for(
    bench: dict[str, ModuleType], tmp_path: Path,
) -> None:
    turns = bench["turns"]
    # A duration of 0 would take no turn at all: the count alone decides.
    a = asyncio.run(turns.level(tmp_path / "a.db", 3, 0.0, turns=4))
    b = asyncio.run(turns.level(tmp_path / "b.db", 3, 0.0, turns=4))
    assert a["turns"] == b["turns"] == 12
    # Activation (1 turn) and 4 timed turns, 2 events each, no fold yet: the same tail.
    assert a["tail_events_at_end"] == b["tail_events_at_end"] == 10
    floor = asyncio.run(turns.naive_level(tmp_path / "naive.db", 3, 0.0, 4))
    assert floor["turns"] == 12


def test_results_state_the_load_the_host_gauge_and_the_instruction_counts(
    bench: dict[str, ModuleType],
) -> None:
    conditions = {"load_average_at_start": [0.14, 0.1, 0.0],
                  "load_average_at_end": [1.02, 0.5, 0.1], "host_gauge_ms": 35.2}
    result: dict[str, Any] = {
        "conditions": conditions,
        "levels": [{"conversations": 100, "turns_each": [3, 9],
                    "naive_instructions_per_turn": 190_000,
                    "torpor_instructions_per_turn": 790_000, "torpor_over_naive": 4.16}],
    }
    report = {"date": "today", "total_seconds": 60.0, "conditions": conditions,
              "machine": {"cores": 2, "ram_bytes": 2**34, "implementation": "CPython",
                          "python": "3.11.7", "platform": "Linux"},
              "benchmarks": {"instructions": {"command": "python bench/instructions.py",
                                              "seconds": 60.0, "result": result}}}
    text = bench["report"].render(report)
    assert "Suite time: 60 s; load average 0.14 before, 1.02 after; host gauge 35.20 ms" in text
    assert "(60.0 s; load average 0.14 before, 1.02 after; host gauge 35.20 ms)" in text
    assert "| 100 | 3 and 9 | 190,000 | 790,000 | 4.16 |" in text
