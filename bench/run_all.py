"""Run the whole benchmark suite at sizes that finish in about twelve minutes on two cores.

Each benchmark runs back to back in its own subprocess (and each of those
starts further fresh processes where memory is compared). The figures land in
``bench/results/latest.json`` and a readable ``bench/RESULTS.md`` (date,
machine and every size that was reduced for time are stated there).

Usage: ``python bench/run_all.py [--quick] [--only NAME ...] [--results DIR] [--markdown FILE]``.
``--quick`` runs tiny sizes to check the suite itself and writes to a temp
directory unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, conditions, machine, run_json
from _report import render

BENCH = ROOT / "bench"

FULL: dict[str, list[str]] = {
    "idle_agents": ["--agents", "10000", "100000", "--active-up-to", "10000",
                    "--trace-agents", "3000", "--lengths", "100", "1000", "10000",
                    "--length-agents", "100"],
    "resume": ["--sizes", "100", "1000", "10000", "100000", "--repeats", "5"],
    "storm": ["--agents", "10000", "--history", "20"],
    "turns": ["--concurrency", "1", "100", "10000", "--turns", "15000"],
    "instructions": ["--concurrency", "1", "100", "--turns", "300", "900"],
    "needles": [],
    "assembly": ["--runs", "500"],
    "store_append": [],
    "adapters": [],
}
QUICK: dict[str, list[str]] = {
    "idle_agents": ["--agents", "500", "--trace-agents", "300", "--lengths", "100", "1000",
                    "--length-agents", "10"],
    "resume": ["--sizes", "100", "1000", "--repeats", "2"],
    "storm": ["--agents", "300", "--history", "4", "--live-cap", "50"],
    "turns": ["--concurrency", "1", "50", "--naive", "1", "50", "--turns", "500"],
    "instructions": ["--concurrency", "10", "--turns", "20", "40"],
    "needles": ["--sizes", "100,200"],
    "assembly": ["--runs", "20", "--calls", "30"],
    "store_append": ["--single", "200", "--conversations", "50", "--events", "5",
                     "--read-conversations", "100", "--read-events", "60", "--samples", "100"],
    "adapters": ["--conversations", "2", "--turns", "5", "--long-turns", "20"],
}
REDUCED = {
    "idle_agents": "torpor-active measured at 10,000 agents only (100,000 active agents "
                   "would need ~1.6 GB and two more minutes); tracemalloc runs use 3,000 "
                   "agents (per-agent cost is flat in N); the length sweep uses 100 agents "
                   "per length",
    "turns": "15,000 timed turns per concurrency level (2 per conversation at 10,000), "
             "the same work on any host",
    "instructions": "300 and 900 turns per level, from turns early in a conversation "
                    "(no fold at 1 conversation)",
    "resume": "5 runs per size (2 above 10,000 events)",
    "assembly": "500 renders per timing (2,000 by default)",
}


def run_external(script: Path, args: list[str]) -> dict[str, Any]:
    """Benchmarks written elsewhere: ``--json FILE`` if they take it, else their last JSON line."""
    try:
        return run_json([str(script), *args], timeout=900)
    except RuntimeError as first:
        proc = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                              text=True, cwd=ROOT, timeout=900, check=False)
        for line in reversed(proc.stdout.strip().splitlines()):
            if line.startswith("{"):
                parsed: dict[str, Any] = json.loads(line)
                return parsed
        raise first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: check the suite runs")
    p.add_argument("--only", nargs="+", choices=list(FULL), default=list(FULL))
    p.add_argument("--results", type=Path, default=None, help="directory for latest.json")
    p.add_argument("--markdown", type=Path, default=None, help="where RESULTS.md goes")
    args = p.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.quick:
        scratch = Path(tempfile.mkdtemp(prefix="torpor-bench-quick-"))
        results_dir = args.results or scratch
        markdown = args.markdown or scratch / "RESULTS.md"
    else:
        results_dir = args.results or BENCH / "results"
        markdown = args.markdown or BENCH / "RESULTS.md"
    results_dir.mkdir(parents=True, exist_ok=True)

    suite_started = time.perf_counter()
    benchmarks: dict[str, Any] = {}
    for name in args.only:
        script = BENCH / f"{name}.py"
        command = f"python bench/{name}.py {' '.join(sizes[name])}".strip()
        print(f"== {command}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        entry: dict[str, Any] = {"command": command}
        if not script.exists():
            entry["error"] = "script not present"
        else:
            try:
                entry["result"] = run_external(script, sizes[name])
            except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
                entry["error"] = str(exc)
        entry["seconds"] = round(time.perf_counter() - started, 1)
        print(f"   {entry['seconds']} s{'  FAILED: ' + entry['error'] if 'error' in entry else ''}",
              file=sys.stderr, flush=True)
        benchmarks[name] = entry
    report = {
        "suite": "torpor benchmarks",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "quick": args.quick,
        "total_seconds": round(time.perf_counter() - suite_started, 1),
        "conditions": conditions(),
        "reduced_for_time": {k: v for k, v in REDUCED.items() if k in args.only},
        "benchmarks": benchmarks,
    }
    (results_dir / "latest.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    markdown.write_text(render(report))
    print(f"wrote {results_dir / 'latest.json'} and {markdown} "
          f"in {report['total_seconds']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
