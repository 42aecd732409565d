"""What the load test shows a person: a summary table, a compact timeline, an optional plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from torpor.cli.common import CliError

__all__ = ["check_plot_available", "plot_timeline", "print_phases", "print_summary",
           "timed_out_line"]


def _mb(value: Any) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f} MB"


def _bytes(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value / 1024:,.2f} KB" if abs(value) >= 1024 else f"{value:,.0f} B"


def _num(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}{unit}"
    return f"{value:,}{unit}"


def print_summary(console: Console, report: Mapping[str, Any]) -> None:
    """The figures table; a section a timed-out run did not reach is left out."""
    config, build = report["config"], report["build"]
    activation, run = report["activation"], report["run"]
    lifecycle, memory = report["lifecycle"], report["memory"]
    table = Table(title=f"torpor loadtest: {config['agents']:,} agents, "
                        f"{config['history']:,} events each", show_lines=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows: list[tuple[str, str]] = []
    if build is not None:
        rows.append(("history built", f"{_num(build['events'])} events in "
                                      f"{build['seconds']:.1f} s "
                                      f"({build['events_per_second']:,.0f}/s)"))
    if activation is not None:
        rows += [
            ("activation", f"{_num(activation['agents'])} agents in "
                           f"{activation['seconds']:.1f} s "
                           f"({_num(activation['agents_per_second'])}/s)"),
            ("revival p50/p99 (activation burst)*",
             f"{_num(activation['revival_p50_ms'], ' ms')} / "
             f"{_num(activation['revival_p99_ms'], ' ms')}"),
        ]
    if run is not None:
        rows += [
            ("driven agents", _num(run["driven_agents"])),
            ("turns/s", _num(run["turns_per_second"])),
            ("turn p50 / p99",
             f"{_num(run['turn_p50_ms'], ' ms')} / {_num(run['turn_p99_ms'], ' ms')}"),
            ("returning users (wakes)", f"{_num(run['wakes'])}, "
                                        f"p50 {_num(run['wake_p50_ms'], ' ms')}, "
                                        f"p99 {_num(run['wake_p99_ms'], ' ms')}"),
        ]
    if lifecycle is not None and activation is not None:
        rows += [
            *_end_of_run_revivals(activation, lifecycle),
            ("hibernations / evictions", f"{_num(lifecycle['hibernations'])} / "
                                         f"{_num(lifecycle['evictions'])}"),
            ("crashes / restarts / parks", f"{lifecycle['crashes']} / "
                                           f"{lifecycle['restarts']} / {lifecycle['parks']}"),
        ]
    if activation is not None:
        errors = activation["errors"] + (sum(run["errors"].values()) if run else 0)
        rows.append(("errors", str(errors)))
    if memory is not None:
        rows += [
            ("RSS before activation", _mb(memory["rss_before_activation_bytes"])),
            ("RSS all active", _mb(memory["rss_after_activation_bytes"])),
            ("RSS end of run / peak", f"{_mb(memory.get('rss_end_of_run_bytes'))} / "
                                      f"{_mb(memory.get('peak_rss_bytes'))}"),
            ("active agent (RSS delta / N)", _bytes(memory["active_rss_bytes_per_agent"])),
        ]
    if memory is not None and "probe_agents" in memory:
        k = memory["probe_agents"]
        rows += [
            (f"active agent (tracemalloc, {k:,})",
             _bytes(memory["probe_active_traced_bytes_per_agent"])),
            (f"hibernated agent (tracemalloc, {k:,})",
             _bytes(memory["probe_hibernated_traced_bytes_per_agent"])),
            (f"evicted agent (tracemalloc, {k:,})",
             _bytes(memory["probe_evicted_traced_bytes_per_agent"])),
        ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if activation is not None:
        console.print(f"* revival: from asking for an evicted conversation to its working set "
                      f"being ready, the wait for one of "
                      f"{_num(config['max_concurrent_revivals'])} revival slots included "
                      f"({_num(activation['agents'])} agents activated at once: mostly "
                      f"queueing); each row covers the latest 4,096 revivals then",
                      markup=False)
    _print_timeline(console, report["timeline"])
    print_phases(console, report)


def print_phases(console: Console, report: Mapping[str, Any]) -> None:
    """How long each phase took: ``--duration`` is only the run's, the rest comes on top."""
    table = Table(title="phases (wall clock)")
    for name in ("phase", "seconds", "CPU s", "ended"):
        table.add_column(name, justify="right", no_wrap=True)
    for phase in report["phases"]:
        table.add_row(phase["name"], f"{phase['seconds']:,.1f}", f"{phase['cpu_seconds']:,.1f}",
                      "yes" if phase["completed"] else "cut by --timeout")
    console.print(table)
    console.print(f"total {report['total_seconds']:.1f} s (--timeout {report['timeout']:g} s)"
                  + (": TIMED OUT" if report["timed_out"] else ""))


def timed_out_line(report: Mapping[str, Any]) -> str:
    cut = next((p["name"] for p in report["phases"] if not p["completed"]), None)
    where = f" during the {cut} phase" if cut else ""
    return (f"torpor loadtest: timed out after {report['timeout']:g} s (--timeout){where}; "
            f"the figures above cover the phases that ran")


def _end_of_run_revivals(
    activation: Mapping[str, Any], lifecycle: Mapping[str, Any]
) -> list[tuple[str, str]]:
    """The revival figures at the end of the run, only if they differ from the burst's
    (both cover the latest 4,096 revivals: without many revivals in the run, the same)."""
    key = ("revival_p50_ms", "revival_p99_ms")
    if [lifecycle[k] for k in key] == [activation[k] for k in key]:
        return []
    return [("revival p50/p99 (end of run)*", f"{_num(lifecycle['revival_p50_ms'], ' ms')} / "
                                              f"{_num(lifecycle['revival_p99_ms'], ' ms')}")]


def _print_timeline(console: Console, samples: Sequence[Mapping[str, Any]]) -> None:
    if not samples:
        return
    table = Table(title="agents per state over time (w/ ws: holding a working set)")
    for name in ("t (s)", "phase", "w/ ws", "hibern.", "evicted", "busy", "turns", "RSS MB"):
        table.add_column(name, justify="right", no_wrap=True)
    step = max(1, len(samples) // 12)
    picked = list(samples[::step])
    if picked[-1] is not samples[-1]:
        picked.append(samples[-1])
    for s in picked:
        table.add_row(f"{s['t']:.1f}", s["phase"], f"{s['with_working_set']:,}",
                      f"{s['hibernated']:,}", f"{s['evicted']:,}", f"{s['busy']:,}",
                      f"{s['turns']:,}", f"{s['rss_bytes'] / 1e6:,.1f}")
    console.print(table)


def check_plot_available() -> None:
    """Fail before the run, not after it, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError("--plot needs matplotlib: pip install 'torpor[plot]'") from None


def plot_timeline(path: str, samples: Sequence[Mapping[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    fig, (states, rss) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    for key, label in (("with_working_set", "with working set"), ("hibernated", "hibernated"),
                       ("evicted", "evicted"), ("busy", "busy (reviving/streaming)")):
        states.plot(t, [s[key] for s in samples], label=label)
    states.set_ylabel("agents")
    states.legend(loc="best")
    states.set_title(title)
    rss.plot(t, [s["rss_bytes"] / 1e6 for s in samples], color="black")
    rss.set_ylabel("RSS (MB)")
    rss.set_xlabel("seconds since activation began")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise CliError(f"cannot write --plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
