"""Turn ``bench/results/latest.json`` into ``bench/RESULTS.md``: tables of the figures, targets.

Every number in the markdown comes from the run's JSON; nothing is typed in.
A benchmark whose JSON shape is unknown (or changed) is shown as a flat list
of its figures rather than dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _targets(targets: dict[str, Any]) -> str:
    if not targets:
        return ""
    return "Targets: " + "; ".join(f"{k} = {_fmt(v)}" for k, v in targets.items()) + ".\n"


def _mb(value: Any) -> float | None:
    return None if value is None else round(value / 1e6, 1)


def idle_agents(r: dict[str, Any]) -> str:
    out = _table(
        ("scenario", "agents", "RSS B/agent", "RSS B/agent net of evicted", "traced B/agent",
         "traced at", "ws tokens", "process RSS MB"),
        [(s["name"], s["agents"], s["rss_bytes_per_agent"],
          s.get("rss_bytes_per_agent_net_of_evicted"), s["traced_bytes_per_agent"],
          s.get("traced_agents"), s.get("working_set_tokens_avg"), _mb(s["rss_total_bytes"]))
         for s in r["scenarios"]],
    )
    out += ("\nRSS B/agent: RSS growth over the scenario / N (it includes SQLite's page cache, "
            "which tracemalloc does not see; \"net of evicted\" subtracts the evicted scenario, "
            "which read the same history). Traced: tracemalloc growth / N.\n\n")
    ratios = {k: v for k, v in r.get("ratios", {}).items() if "/" in k and isinstance(v, dict)}
    if ratios:
        out += _table(("ratio", "RSS", "traced"),
                      [(k, v["rss"], v["traced"]) for k, v in ratios.items()])
    burst = {k: v for k, v in r.get("ratios", {}).items() if k.startswith("burst/gradual")}
    if burst:  # after every agent was active at once, then hibernated: process RSS
        out += "\nAfter a burst vs gradual hibernation (process RSS): " + ", ".join(
            f"{_fmt(v)}x at {k.rsplit('@', 1)[-1]} agents" for k, v in burst.items()) + ".\n"
    if r.get("length_sweep"):
        out += "\nFootprint vs conversation length (tracemalloc bytes per agent; " \
               f"{r['length_sweep'][0]['agents']} agents per length, working budget " \
               f"{r['params'].get('length_budget')} tokens):\n\n"
        out += _table(("events", "torpor active", "torpor hibernated", "naive", "ws tokens"),
                      [(s["events"], s["torpor_active_traced"], s["torpor_hibernated_traced"],
                        s["naive_traced"], s["working_set_tokens_avg"])
                       for s in r["length_sweep"]])
        growth = {k: v for k, v in r.get("ratios", {}).items() if k.startswith("length_growth")}
        if growth:
            out += "\nLargest / smallest across lengths: " + ", ".join(
                f"{k.removeprefix('length_growth_')} {_fmt(v)}x" for k, v in growth.items()) + ".\n"
    return out + "\n" + _targets(r.get("targets", {}))


def resume(r: dict[str, Any]) -> str:
    rows = [(x["events"], x["torpor"].get("tail_events"), x["torpor"]["p50_ms"],
             x.get("openai-agents", {}).get("p50_ms"), x.get("langgraph", {}).get("p50_ms"),
             x.get("openai-agents/torpor"), x.get("langgraph/torpor")) for x in r["rows"]]
    out = _table(("events", "torpor tail events", "torpor ms", "OpenAI Agents SQLiteSession ms",
                  "LangGraph AsyncSqliteSaver ms", "SQLiteSession / torpor",
                  "LangGraph / torpor"), rows)
    for peer, why in r.get("peers_skipped", {}).items():
        out += f"\n{peer}: skipped, {why}.\n"
    return out + "\n" + _targets(r.get("targets", {}))


def storm(r: dict[str, Any]) -> str:
    out = _table(
        ("variant", "revival cap", "live cap", "seconds", "answers/s", "p50 ms", "p99 ms",
         "errors", "peak RSS growth MB", "peak live agents"),
        [(v["variant"], v["max_concurrent_revivals"], v["max_live_agents"], v["seconds"],
          v["answers_per_second"], v["answer_p50_ms"], v["answer_p99_ms"],
          sum(v["errors"].values()), _mb(v["peak_rss_growth_bytes"]), v["peak_live_agents"])
         for v in r["variants"]],
    )
    return out + "\n" + _targets(r.get("targets", {}))


def turns(r: dict[str, Any]) -> str:
    out = _table(
        ("concurrent conversations", "turns/s", "overhead µs/turn", "model µs/turn",
         "CPU µs/turn", "p50 ms", "p99 ms", "p99/p50", "tail events at end", "max WAL MB",
         "errors"),
        [(x["conversations"], x["turns_per_second"], x["overhead_us_per_turn"],
          x["model_us_per_turn"], x["cpu_us_per_turn"], x["latency_p50_ms"],
          x["latency_p99_ms"], x.get("p99_over_p50"), x.get("tail_events_at_end"),
          _mb(x.get("max_wal_bytes")), x["errors"]) for x in r["levels"]],
    )
    floors = [x for x in r["levels"] if "naive" in x]
    if floors:
        out += ("\nAgainst the naive aiosqlite loop (same two durable commits per turn, same "
                "run; torpor/naive is how many times longer a torpor turn takes):\n\n")
        out += _table(
            ("concurrent conversations", "naive turns/s", "torpor turns/s", "torpor/naive time",
             "naive CPU µs/turn", "torpor CPU µs/turn", "torpor/naive CPU", "naive p50 ms",
             "naive p99 ms"),
            [(x["conversations"], x["naive"]["turns_per_second"], x["turns_per_second"],
              x["torpor_over_naive"], x["naive"]["cpu_us_per_turn"], x["cpu_us_per_turn"],
              x.get("torpor_over_naive_cpu"), x["naive"]["latency_p50_ms"],
              x["naive"]["latency_p99_ms"]) for x in floors],
        )
    return out + "\n" + _targets(r.get("targets", {}))


def instructions(r: dict[str, Any]) -> str:
    out = _table(
        ("concurrent conversations", "turns each (two runs)", "naive instructions/turn",
         "torpor instructions/turn", "torpor/naive"),
        [(x["conversations"], f"{x['turns_each'][0]:,} and {x['turns_each'][1]:,}",
          x["naive_instructions_per_turn"], x["torpor_instructions_per_turn"],
          x["torpor_over_naive"]) for x in r["levels"]],
    )
    return out + ("\nCounted by valgrind (user space, every thread; the kernel's share of a "
                  "commit is not in it) as the difference between two runs of turns.py's level "
                  "code, so start-up and activation cancel out: the same on any host and under "
                  "any load, unlike the µs above.\n")


def needles(r: dict[str, Any]) -> str:
    out = _table(
        ("events", "torpor recall@10", "truncation recall@10", "events in context",
         "markers", "live fold ms", "revived fold ms", "revived / live", "revived build ms"),
        [(x["events"], x["torpor"]["recall_at_10"], x["truncation"]["recall_at_10"],
          x["torpor"]["events_in_context"], x["torpor"]["markers_in_context"],
          x["compaction_latency"]["live"]["median_us"] / 1000,
          x["compaction_latency"]["revived"]["median_us"] / 1000,
          x["compaction_latency"].get("revived_over_live"),
          x["compaction_latency"].get("revived_build", {}).get("median_us", 0) / 1000)
         for x in r["results"]],
    )
    first = r.get("runtime_first_turn")
    if first:
        out += (f"\nThrough the runtime, {first['events']:,} imported events never folded: "
                f"first turn {first['first_turn']['median_us'] / 1000:.1f} ms, longest "
                f"event-loop stall {first['longest_stall']['median_us'] / 1000:.1f} ms "
                f"(medians of {first['first_turn']['runs']}).\n")
    return out


def assembly(r: dict[str, Any]) -> str:
    timing = _table(
        ("shape", "messages", "render µs", "per turn render µs", "from scratch µs",
         "memory KB", "estimated KB"),
        [(x["shape"], x["messages"], x["timing"]["render"]["median_us"],
          x["per_turn"]["render"]["median_us"], x["per_turn"]["render_from_scratch"]["median_us"],
          x["memory"]["tracemalloc_bytes"] / 1024, x["memory"]["estimated_bytes"] / 1024)
         for x in r["results"]],
    )
    cache = _table(
        ("shape", "clear_at_least", "calls", "prefix breaks / 100 calls", "at folds",
         "at clears", "other", "uncached tokens / call", "re-sent tokens / 100 calls",
         "cacheable share"),
        [(x["shape"], x["clear_at_least"], x["calls"], x["breaks_per_100_calls"], x["at_fold"],
          x["at_clear"], x["other"], x["uncached_tokens_per_call"],
          x["resent_tokens_per_100_calls"], x["cacheable_share"])
         for x in r.get("prompt_cache", [])],
    )
    return timing + "\n" + cache


def adapters(r: dict[str, Any]) -> str:
    out = _table(
        ("provider", "client", "deltas", "overhead µs/turn", "p50", "client CPU µs/turn",
         "server µs"),
        [(x["provider"], x["client"], x["deltas"], x["overhead_us_mean"], x["overhead_us_p50"],
          x["client_cpu_us_per_turn"], x["server_us_mean"]) for x in r["overhead"]],
    )
    out += "\nPer streamed delta (µs):\n\n" + _table(
        ("provider", "client", "wall", "CPU"),
        [(x["provider"], x["client"], x["us_per_delta"], x["cpu_us_per_delta"])
         for x in r["per_delta"]],
    )
    out += "\nBytes sent per turn:\n\n" + _table(
        ("provider", "policy", "turns", "folds", "mean B/turn", "total MB", "new B/turn",
         "prefix share"),
        [(x["provider"], x["policy"], x["turns"], x["folds"], x["bytes_per_turn_mean"],
          x["total_mb"], x["new_bytes_per_turn_mean"], x["prefix_share"]) for x in r["resent"]],
    )
    return out


def _flatten(value: Any, prefix: str, out: list[tuple[str, Any]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, list) and all(isinstance(v, dict) for v in value):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", out)
    elif isinstance(value, int | float | bool | str) or value is None:
        out.append((prefix, value))


def generic(r: dict[str, Any]) -> str:
    flat: list[tuple[str, Any]] = []
    _flatten({k: v for k, v in r.items() if k not in ("machine", "date")}, "", flat)
    return _table(("figure", "value"), flat[:60])


RENDERERS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "idle_agents": ("Idle agents: bytes per agent", idle_agents),
    "resume": ("Resume a conversation and append one turn", resume),
    "storm": ("Activation storm", storm),
    "turns": ("Turns per second and runtime overhead", turns),
    "instructions": ("Instructions per turn: the figure any host reproduces", instructions),
    "needles": ("Needles: pointer folding vs truncation", needles),
    "assembly": ("Assembly per model call, and the prompt prefix a provider can cache", assembly),
    "store_append": ("Store: append throughput and read latency", generic),
    "adapters": ("Provider adapters over HTTP: overhead vs the SDK, bytes re-sent", adapters),
}


def _conditions(c: dict[str, Any] | None) -> str:
    """"load average 0.14 before, 1.02 after; host gauge 35.2 ms" (empty if not recorded)."""
    if not c:
        return ""
    return (f"; load average {_fmt(c['load_average_at_start'][0])} before, "
            f"{_fmt(c['load_average_at_end'][0])} after; host gauge {_fmt(c['host_gauge_ms'])} ms")


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    ram = f"{m['ram_bytes'] / 2**30:.1f} GiB" if m.get("ram_bytes") else "unknown"
    parts = [
        "# torpor benchmark results\n",
        f"Generated by `python bench/run_all.py` on {report['date']}"
        + (" (**quick sizes**, not representative)" if report.get("quick") else "") + ".\n",
        f"Machine: {m['cores']} cores, {ram} RAM, {m['implementation']} {m['python']} "
        f"({m['platform']}). Suite time: {report['total_seconds']:,.0f} s"
        f"{_conditions(report.get('conditions'))}. Raw figures: `bench/results/latest.json`.\n",
        "Load average: the host's 1-minute load as a benchmark started (other processes') and "
        "as it ended (its own included). Host gauge: CPU ms of a fixed pure-Python workload "
        "(`bench/_common.py`), the fastest of 7: µs figures scale with it from host to host "
        "(the same code and work cost 1.5-1.7x the CPU on one host of this workplace as on "
        "another), while instruction counts do not.\n",
    ]
    if report.get("reduced_for_time"):
        parts.append("Sizes reduced for time:\n")
        parts += [f"- {k}: {v}" for k, v in report["reduced_for_time"].items()]
        parts.append("")
    for name, entry in report["benchmarks"].items():
        title, renderer = RENDERERS.get(name, (name, generic))
        parts.append(f"## {title}\n")
        if "error" in entry:
            parts.append(f"`{entry['command']}` ({entry['seconds']} s)\n")
            parts.append(f"Not measured: {entry['error']}\n")
            continue
        result = entry["result"]
        parts.append(f"`{entry['command']}` ({entry['seconds']} s"
                     f"{_conditions(result.get('conditions'))})\n")
        try:
            parts.append(renderer(result))
        except (KeyError, TypeError, IndexError):
            parts.append(generic(result))
        for note in result.get("notes", []):
            parts.append(f"Note: {note}.\n")
    return "\n".join(parts).rstrip() + "\n"
