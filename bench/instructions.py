"""Instructions per turn, torpor and the naive floor: a figure any host reproduces.

Question: how much work is a torpor turn, against the hand-rolled aiosqlite loop of
``turns.py``, in a unit that neither the host's speed nor its load changes?

Times and CPU seconds per turn move with the host (the same code and the same work,
down to the tail lengths and the collector's runs, cost 105 µs a turn on the host that
wrote one RESULTS.md and 175 µs on another) and, for the floor, with how its aiosqlite
thread is scheduled (43 to 92 µs a turn back to back on one idle host). Instructions
do not: each figure here is counted by valgrind (``cachegrind --cache-sim=no``, every
thread, user space only: the kernel's share of a commit is not in it) over a fixed
number of turns, as the difference between two runs of ``turns.py``'s own level code
(``--turns`` N1, then N2) so that start-up, imports and activation cancel out.
PYTHONHASHSEED is fixed so two runs take the same paths.

Usage: ``python bench/instructions.py [--concurrency 1 100] [--turns 1000 4000]
[--json FILE]`` (valgrind must be installed: ``apt-get install valgrind``). About a
minute per run under valgrind, four runs per level. Each level's turns are spread over
its conversations as in ``turns.py --turns``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import ROOT, emit, fresh_db, quiet, ratio, table

_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def child(kind: str, conversations: int, each: int) -> None:
    """One level of turns.py's code, ``each`` timed turns per conversation, then exit."""
    from turns import level, naive_level

    quiet()
    with tempfile.TemporaryDirectory(prefix="torpor-instr-") as tmp:
        if kind == "naive":
            asyncio.run(naive_level(Path(tmp) / "naive.db", conversations, 0.0, each))
        else:
            db = Path(fresh_db(Path(tmp), "turns.db").removeprefix("sqlite:///"))
            asyncio.run(level(db, conversations, 0.0, turns=each))


def count(kind: str, conversations: int, each: int) -> int:
    """Instructions valgrind counts in a child running ``each`` turns per conversation."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         sys.executable, __file__, "--child", kind, str(conversations), str(each)],
        capture_output=True, text=True, cwd=ROOT, env=env, check=False, timeout=3600,
    )
    found = _REFS.findall(proc.stderr)
    if proc.returncode != 0 or not found:
        tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"valgrind {kind} {conversations}x{each} exited "
                           f"{proc.returncode}: {tail}")
    return int(found[-1].replace(",", ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 100])
    p.add_argument("--turns", type=int, nargs=2, default=[1000, 4000], metavar=("N1", "N2"),
                   help="turns per level in the two runs whose difference is measured")
    p.add_argument("--child", nargs=3, metavar=("KIND", "C", "EACH"), help=argparse.SUPPRESS)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    if args.child:
        kind, conversations, each = args.child
        child(kind, int(conversations), int(each))
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    n1, n2 = sorted(args.turns)
    rows: list[dict[str, Any]] = []
    for c in args.concurrency:
        e1, e2 = -(-n1 // c), -(-n2 // c)  # turns per conversation, as turns.py --turns
        if e1 == e2:
            sys.exit(f"--turns {n1} {n2} give {c} conversations the same turns each")
        row: dict[str, Any] = {"conversations": c, "turns_each": [e1, e2]}
        for kind in ("naive", "torpor"):
            first, second = count(kind, c, e1), count(kind, c, e2)
            row[f"{kind}_instructions_per_turn"] = round((second - first) / ((e2 - e1) * c))
            print(f"  {c:,} conversations, {kind}: "
                  f"{row[f'{kind}_instructions_per_turn']:,} instructions/turn", file=sys.stderr)
        row["torpor_over_naive"] = ratio(row["torpor_instructions_per_turn"],
                                         row["naive_instructions_per_turn"])
        rows.append(row)
    result = {"benchmark": "instructions",
              "params": {"concurrency": args.concurrency, "turns": [n1, n2]},
              "levels": rows}
    emit(result, [table(
        "instructions per turn (valgrind, user space, every thread)",
        ("conversations", "turns each", "naive", "torpor", "torpor/naive"),
        [(r["conversations"], f"{r['turns_each'][0]}→{r['turns_each'][1]}",
          r["naive_instructions_per_turn"], r["torpor_instructions_per_turn"],
          r["torpor_over_naive"]) for r in rows])], args.json)


if __name__ == "__main__":
    main()
